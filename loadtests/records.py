"""What one benchmarked request leaves behind; the metrics, report and plots read only this."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    """Timings and token counts of one request; times are seconds from the start of the run."""

    session_id: int
    turn_index: int
    success: bool
    prompt_len: int
    """Prompt tokens: the server's count when it reports one, else the benchmark tokenizer's."""
    output_len: int
    """Generated tokens: the server's count when it reports one, else the tokenizer's count of the text."""
    start_s: float
    latency_s: float
    max_output_len: int = 0
    """Tokens asked for (exactly these when EOS was ignored)."""
    """End-to-end: from sending the request to the end of its response."""
    ttft_s: float | None = None
    """Time to the first chunk with generated text (None when none came)."""
    itl_s: list[float] = field(default_factory=list)
    """Gaps between successive chunks with generated text."""
    cached_len: int | None = None
    """Prompt tokens served from the prefix cache, as the server reports them (None: not reported)."""
    error: str = ""
    status: int | None = None
    """HTTP status (None when no response came)."""
    group_id: int | None = None
    output_text: str = ""
    tokenize_s: float | None = None
    """The server's own time to turn the prompt's text into token ids (its `Server-Timing: tokenize`), when it
    reports one: the part of `ttft_s` spent tokenizing."""

    @property
    def end_s(self) -> float:
        return self.start_s + self.latency_s

    def chunk_times_s(self) -> list[float]:
        """Arrival times of the chunks with text, from the start of the run."""
        if self.ttft_s is None:
            return []
        times = [self.start_s + self.ttft_s]
        for gap in self.itl_s:
            times.append(times[-1] + gap)
        return times

    def to_dict(self, with_text: bool = False) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if not with_text:
            data.pop("output_text")
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
