"""Tool calling: parsers per model family (registry), constrained calls, prompts and streamed deltas."""
