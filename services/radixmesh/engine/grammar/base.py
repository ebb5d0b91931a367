"""The grammar-backend contract: compile specs for one tokenizer, run one matcher per request.

Threading: `compile` and `deserialize` run on the scheduler's compile threads and
must be thread-safe; the matcher methods and the mask methods run on the scheduler
thread only.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from radixmesh.engine.grammar.spec import GrammarSpec


class GrammarMatcher(Protocol):
    """The state of one request inside its grammar, advanced token by token."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar does not allow it."""

    def rollback(self, num_tokens: int = 1) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    def find_jump_forward_string(self) -> str:
        """The longest text every continuation starts with ("" when the next byte is free)."""

    def is_terminated(self) -> bool:
        """True once a stop token was accepted: nothing more may follow."""


class BaseGrammarBackend(abc.ABC):
    """Turns `GrammarSpec`s into compiled grammars for one vocabulary and fills token masks.

    A compiled grammar is immutable and shared by every request with the same spec. A mask
    is an int32 CPU tensor `[batch, ceil(vocab_size / 32)]` whose bit j of row i says whether
    token j is allowed for row i.
    """

    id: str
    """Registry id (kebab-case), as in --grammar-backend."""

    @abc.abstractmethod
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], num_threads: int = 1) -> None:
        """Read the vocabulary of a Hugging Face `tokenizer` for logits `vocab_size` wide; a grammar
        ends with one of `stop_token_ids`."""

    @classmethod
    @abc.abstractmethod
    def check_syntax(cls, spec: GrammarSpec) -> None:
        """Raise INVALID_ARGUMENT naming what is wrong with the spec; needs no tokenizer."""

    @property
    @abc.abstractmethod
    def serialization_version(self) -> str:
        """Changes whenever `serialize` output would no longer `deserialize`."""

    @abc.abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar (may take seconds for large schemas)."""

    @abc.abstractmethod
    def serialize(self, compiled: Any) -> bytes:
        """Bytes another process with the same tokenizer can `deserialize`."""

    @abc.abstractmethod
    def deserialize(self, data: bytes) -> Any:
        """The compiled grammar behind `serialize`'s bytes; raises ValueError if they do not fit."""

    @abc.abstractmethod
    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""

    @abc.abstractmethod
    def allocate_mask(self, batch_size: int, pinned: bool = False) -> torch.Tensor:
        """An all-allowed mask for `batch_size` rows (CPU; page-locked with `pinned`, so that its
        copy to a GPU need not wait for the work queued there)."""

    @abc.abstractmethod
    def fill_masks(self, matchers: list[GrammarMatcher], mask: torch.Tensor, rows: list[int]) -> None:
        """Write the allowed next tokens of `matchers[i]` into `mask[rows[i]]`."""
