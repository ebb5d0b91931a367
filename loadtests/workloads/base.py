"""What a workload produces: sessions of turns, generated deterministically from a seed.

A single-turn workload makes one-turn sessions. In a multi-turn session every turn after
the first is sent with the whole history (earlier user turns and the server's replies), so
the runner sends a session's turns one after another.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from typing import Any, Protocol


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the workloads use."""

    all_special_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class Turn:
    """One request's new content; the history before it is rebuilt by the runner."""

    prompt: str | list[int]
    """User text, or token ids (sent as is; single-turn sessions only)."""
    prompt_len: int
    """Tokens of `prompt` alone, by the benchmark's tokenizer."""
    output_len: int
    """Tokens asked for (max_tokens)."""
    ignore_eos: bool = True
    """Ask the server to generate exactly `output_len` tokens."""
    response_format: dict[str, Any] | None = None
    """OpenAI `response_format` (json-schema workload)."""


@dataclass(frozen=True)
class Session:
    """A conversation: its turns are sent in order, each with the history before it."""

    session_id: int
    turns: tuple[Turn, ...]
    group_id: int | None = None
    """Shared-prefix group (generated-shared-prefix), for analysis."""

    @property
    def num_turns(self) -> int:
        return len(self.turns)


@dataclass(frozen=True)
class Workload:
    """A generated workload and the parameters that made it."""

    name: str
    sessions: tuple[Session, ...]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(s.num_turns for s in self.sessions)

    @property
    def total_prompt_len(self) -> int:
        return sum(t.prompt_len for s in self.sessions for t in s.turns)


class WorkloadBuilder(Protocol):
    """One workload kind: its CLI flags and its generator.

    `build` must be a pure function of (args, tokenizer, num_prompts, seed): the same inputs
    give the same sessions, so runs against different endpoints compare.
    """

    def add_args(self, parser: argparse.ArgumentParser) -> None: ...

    def build(self, args: argparse.Namespace, tokenizer: Tokenizer, num_prompts: int, seed: int) -> Workload: ...


def sample_lens(rng: random.Random, full_len: int, range_ratio: float, num: int) -> list[int]:
    """`num` lengths uniform in [max(int(full_len * range_ratio), 1), full_len] (SGLang's rule)."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range ratio must be in [0, 1], got {range_ratio}")
    if full_len < 1:
        raise ValueError(f"length must be >= 1, got {full_len}")
    low = max(int(full_len * range_ratio), 1)
    return [rng.randint(low, full_len) for _ in range(num)]


def usable_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Vocabulary ids without the special tokens (random prompts must not contain EOS)."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def random_token_ids(rng: random.Random, vocab: list[int], num_tokens: int) -> list[int]:
    return rng.choices(vocab, k=num_tokens)


def random_text(rng: random.Random, tokenizer: Tokenizer, vocab: list[int], num_tokens: int) -> str:
    """Text decoded from `num_tokens` random ids; re-encoding it gives about `num_tokens` tokens."""
    return tokenizer.decode(random_token_ids(rng, vocab, num_tokens), skip_special_tokens=True)


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def completion_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids a radixmesh server makes of a text prompt of /v1/completions or /generate: the tokenizer's encode with
    the special tokens (a BOS where the model's tokenizer adds one), as the gateway's `TokenizerPool.encode` does."""
    return list(tokenizer.encode(text, add_special_tokens=True))


def check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
