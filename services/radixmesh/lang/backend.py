"""What a program's state needs from the model runtime, and the default backend of programs."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.lang.ir import GenParams


@dataclass(frozen=True)
class GenResult:
    """One generation: its text and the server's meta_info (prompt_tokens, cached_tokens, ...)."""

    text: str
    meta_info: dict[str, Any]
    start_s: float
    """time.perf_counter() when the request was sent (client side)."""
    end_s: float
    """time.perf_counter() when its last byte arrived."""


@dataclass(frozen=True)
class SelectResult:
    """How `select` scored its choices; `index` is the argmax of `logprobs` (first on ties)."""

    index: int
    logprobs: list[float]
    """Total log-probability of each choice's tokens after the prefix."""
    num_tokens: list[int]
    """How many tokens were scored for each choice."""
    meta_info: list[dict[str, Any]] = field(default_factory=list)
    """The server's meta_info per choice."""

    @property
    def normalized_logprobs(self) -> list[float]:
        """Mean log-probability per scored token."""
        return [lp / max(n, 1) for lp, n in zip(self.logprobs, self.num_tokens)]


class BaseBackend(ABC):
    """A model runtime for programs; every method may be called from several threads at once.

    Failures raise `RadixMeshError` (UNAVAILABLE when the runtime cannot be reached).
    """

    @abstractmethod
    def generate(self, prompt: str, params: GenParams,
                 on_text: Callable[[str], None] | None = None) -> GenResult:
        """Continue `prompt`; with `on_text`, stream and call it with each new piece of text."""

    @abstractmethod
    def select(self, prompt: str, choices: tuple[str, ...]) -> SelectResult:
        """Score each choice as a continuation of `prompt` by its total log-probability, in one batch."""

    @abstractmethod
    def cache_prefix(self, prompt: str) -> None:
        """Compute `prompt`'s KV once so that concurrent continuations of it hit the prefix cache."""

    @abstractmethod
    def role_markers(self, history: tuple[str, ...], role: str) -> tuple[str, str]:
        """Text that opens and closes a `role` message after messages of roles `history`."""


_default: BaseBackend | None = None
_default_lock = threading.Lock()


def set_default_backend(backend: BaseBackend) -> None:
    """The backend programs run on when `run` is given none."""
    global _default
    with _default_lock:
        _default = backend


def get_default_backend() -> BaseBackend:
    with _default_lock:
        if _default is None:
            raise RadixMeshError(ErrorCode.INVALID_ARGUMENT,
                                 "no backend: call set_default_backend(RuntimeEndpoint(url)) or pass backend=")
        return _default
