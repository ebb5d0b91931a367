"""Reference answers for the service tests: greedy output ids of the session's in-process engine."""

from __future__ import annotations

from typing import Any


def greedy_ids(engine: Any, prompts: list[Any], max_new_tokens: int) -> list[list[int]]:
    """Greedy output ids of `prompts` (text or token ids), from an empty prefix cache."""
    assert engine.flush_cache()
    results = engine.generate(prompts, {"max_new_tokens": max_new_tokens, "temperature": 0.0})
    assert isinstance(results, list)
    return [list(r["output_ids"]) for r in results]
