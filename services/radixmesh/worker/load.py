"""The front end's view of its sequences, for the load a router scores (queued prefill work,
running decode tokens). The scheduler's own stats add KV usage and cache hit rate."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class SeqLoad:
    """One admitted sequence."""

    prompt_len: int
    num_output_tokens: int = 0
    started: bool = False
    """The scheduler has prefilled it (the first message arrived)."""


class LoadTracker:
    """Counts tokens of the sequences in flight through this front end."""

    def __init__(self) -> None:
        self.active: dict[str, SeqLoad] = {}

    @contextlib.contextmanager
    def track(self, rid: str, prompt_len: int) -> Iterator[SeqLoad]:
        seq = SeqLoad(prompt_len)
        self.active[rid] = seq
        try:
            yield seq
        finally:
            self.active.pop(rid, None)

    @staticmethod
    def update(seq: SeqLoad, num_new_tokens: int) -> None:
        seq.started = True
        seq.num_output_tokens += num_new_tokens

    @property
    def num_queued_prefill_tokens(self) -> int:
        """Prompt tokens of sequences not prefilled yet (cache hits not subtracted)."""
        return sum(s.prompt_len for s in self.active.values() if not s.started)

    @property
    def num_running_decode_tokens(self) -> int:
        """Tokens (prompt + output so far) held by sequences that are decoding."""
        return sum(s.prompt_len + s.num_output_tokens for s in self.active.values() if s.started)
