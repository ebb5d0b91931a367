"""What a request's client receives of one scheduler message: text (already stop-trimmed) and token counts."""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.wire.messages import TokenOut


@dataclass
class GenerationChunk:
    """What one scheduler message adds to a request, with its text already stop-trimmed."""

    rid: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    input_logprobs: list[float | None] | None = None
    """Prompt-token log-probs (from `logprob_start_len` on) that arrived with this chunk."""
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    engine_ttft_s: float | None = None
    """First chunk only: seconds from the front end's call into the engine to the engine's first message
    (queue wait and prefill); the gateway's TTFT less this is what the serving path itself added."""

    @classmethod
    def of(cls, out: TokenOut, text: str = "") -> GenerationChunk:
        """The chunk of one scheduler message, with its (already trimmed) text."""
        return cls(out.rid, text, list(out.token_ids), out.prompt_tokens, out.cached_tokens, out.completion_tokens,
                   out.logprobs, out.top_logprobs, out.finish_reason, out.matched_stop, out.input_logprobs,
                   out.input_top_logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
