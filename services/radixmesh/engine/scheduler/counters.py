"""What the scheduler counts for /server_info and the benchmarks (one object its parts share)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class SchedulerCounters:
    """Totals since the scheduler started (or since the warm-up, which resets them)."""

    num_prompt_tokens: int = 0
    """Prompt tokens of admitted requests (each request once, however often it was re-admitted)."""
    num_cached_tokens: int = 0
    """Of those, tokens found in the prefix cache at first admission."""
    num_generated_tokens: int = 0
    """Output tokens appended to requests (jump-forward tokens included)."""
    num_forward_passes: int = 0
    """Batches launched."""
    num_retractions: int = 0
    """Requests sent back to the queue because decode ran out of KV."""
    result_wait_s: float = 0.0
    """Host time spent waiting for results to reach the host (one wait per processed batch)."""

    def reset(self) -> None:
        """Every counter back to zero, in place (the scheduler's parts hold this object)."""
        for field in fields(self):
            setattr(self, field.name, field.default)
