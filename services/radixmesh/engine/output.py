"""Turns the scheduler's token stream into text and SGLang-style result dicts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixmesh.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.outputs import GenerationChunk
from radixmesh.wire.sampling import SamplingParams


class TextAssembler:
    """Per request: incremental detokenization, stop-string hold-back and trimming."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stop = StopStringMatcher(params.stop) if params.stop else None
        self.stop_ids = set(params.stop_token_ids)
        self.stopped = False

    def feed(self, out: TokenOut) -> GenerationChunk:
        ids = out.token_ids
        if out.finish_reason == "stop" and isinstance(out.matched_stop, int) and ids:
            ids = ids[:-1]  # the stop token itself is not part of the text
        text = self.detok.add(ids) if ids else ""
        if out.finish_reason is not None:
            text += self.detok.flush()
        text = self._apply_stop(text, final=out.finish_reason is not None)
        return GenerationChunk.of(out, text)

    def _apply_stop(self, text: str, final: bool) -> str:
        if self.stop is None or self.stopped:
            return "" if self.stopped else text
        safe, hit = self.stop.feed(text)
        if hit:
            self.stopped = True
            return safe
        return safe + self.stop.flush() if final else safe


@dataclass
class GenerationResult:
    """A whole completion, accumulated from its chunks."""

    rid: str
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    input_ids: list[int] = field(default_factory=list)
    """The prompt, to pair prompt-token log-probs with their tokens."""
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)

    def add(self, chunk: GenerationChunk) -> None:
        self.text += chunk.text
        self.output_ids += chunk.token_ids
        self.prompt_tokens, self.cached_tokens = chunk.prompt_tokens, chunk.cached_tokens
        self.completion_tokens = chunk.completion_tokens
        self.logprobs += chunk.logprobs or []
        self.top_logprobs += chunk.top_logprobs or []
        self.input_logprobs += chunk.input_logprobs or []
        self.input_top_logprobs += chunk.input_top_logprobs or []
        if chunk.finish_reason is not None:
            self.finish_reason, self.matched_stop = chunk.finish_reason, chunk.matched_stop

    def to_dict(self) -> dict[str, Any]:
        """The SGLang native-API shape: text, output_ids and meta_info."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": ({"type": self.finish_reason, "matched": self.matched_stop}
                              if self.finish_reason else None),
        }
        if self.logprobs:
            meta["output_token_logprobs"] = list(zip(self.logprobs, self.output_ids))
        if self.top_logprobs:
            meta["output_top_logprobs"] = self.top_logprobs
        if self.input_logprobs:
            scored = self.input_ids[len(self.input_ids) - len(self.input_logprobs):]
            meta["input_token_logprobs"] = list(zip(self.input_logprobs, scored))
        if self.input_top_logprobs:
            meta["input_top_logprobs"] = self.input_top_logprobs
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": meta}
