"""The contract of a routing policy, and what a routing decision records."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from radixmesh.router.workers import WorkerHandle

if TYPE_CHECKING:
    from radixmesh.router.peer_hint import PeerHint


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may look at: sizes and the prompt's block chain, never the text."""

    request_id: str
    """The sequence's id."""
    num_prompt_tokens: int
    """Prompt length in tokens."""
    block_hashes: tuple[int, ...]
    """Chained keys of the prompt's full blocks (radixmesh.wire.block_hash)."""
    block_size: int
    """Tokens per block of `block_hashes`."""
    lora_name: str = ""
    """The LoRA adapter it runs with ("" for the base model); its block hashes carry the adapter's extra key."""

    @property
    def routing_key(self) -> bytes:
        """Stable bytes naming the prompt's start, for deterministic tie-breaks across routers."""
        if self.block_hashes:
            return self.block_hashes[0].to_bytes(8, "little")
        return self.request_id.encode()


@dataclass
class RoutingDecision:
    """The chosen worker and why; `attributes()` is what traces and debug logs record."""

    worker: WorkerHandle
    """The chosen worker."""
    policy: str
    """Id of the policy that decided (approx-tree when cache-aware fell back)."""
    reason: str
    """cache-hit | new-prefix | load-imbalance | round-robin | random | power-of-two | only-candidate."""
    scores: dict[str, float] = field(default_factory=dict)
    """worker id -> score (higher is better) for every candidate."""
    cached_tokens: dict[str, int] = field(default_factory=dict)
    """worker id -> prompt tokens it is believed to hold (cache-aware policies)."""
    cached_blocks: int = 0
    """Leading blocks of the prompt the chosen worker is believed to hold."""
    prefill: RoutingDecision | None = None
    """Disaggregation: the prefill worker's decision, when the chosen (decode) worker gets one."""
    pd_reason: str = ""
    """For a decode worker: prefill-tier (it gets `prefill`) | short-prompt | no-prefill-worker; else ""."""
    peer: PeerHint | None = None
    """Prefix sharing: another worker holding more of the prompt on its device, named to the chosen one."""

    def attributes(self) -> dict[str, str | int | float]:
        attrs: dict[str, str | int | float] = {
            "routing.policy": self.policy, "routing.reason": self.reason,
            "routing.worker_id": self.worker.worker_id, "routing.worker_address": self.worker.address,
            "routing.num_candidates": len(self.scores),
        }
        for worker_id, score in sorted(self.scores.items()):
            attrs[f"routing.candidate.{worker_id}.score"] = round(score, 6)
            attrs[f"routing.candidate.{worker_id}.cached_tokens"] = self.cached_tokens.get(worker_id, 0)
        if self.pd_reason:
            attrs["routing.pd_reason"] = self.pd_reason
        if self.peer is not None:
            attrs["routing.peer_worker_id"] = self.peer.worker.worker_id
            attrs["routing.peer_cached_tokens"] = self.peer.num_tokens
        if self.prefill is not None:
            attrs["routing.prefill_worker_id"] = self.prefill.worker.worker_id
            attrs["routing.prefill_worker_address"] = self.prefill.worker.address
            attrs["routing.prefill_policy"] = self.prefill.policy
            for worker_id, score in sorted(self.prefill.scores.items()):
                attrs[f"routing.prefill_candidate.{worker_id}.score"] = round(score, 6)
                attrs[f"routing.prefill_candidate.{worker_id}.cached_tokens"] = \
                    self.prefill.cached_tokens.get(worker_id, 0)
        return attrs


class BaseRoutingPolicy(ABC):
    """Picks one worker per request among the available candidates.

    `choose` gets at least one candidate (the router never calls it with none) and returns a
    decision naming one of them, with a score for every candidate: higher is better; cache-aware
    scores lie in [-load_weight, 1], the others in [0, 1]. `on_routed` is told of every request
    the router actually sent (after `choose`, or a retry's `choose`).
    """

    policy_id: ClassVar[str]

    @abstractmethod
    async def choose(self, request: RouteRequest, candidates: Sequence[WorkerHandle]) -> RoutingDecision:
        """The worker for `request`."""

    async def on_routed(self, request: RouteRequest, decision: RoutingDecision) -> None:  # noqa: B027
        """Bookkeeping after dispatch (speculative index entries, the approximate tree)."""

    def active_policy(self) -> str:
        """The id that currently decides (differs from policy_id while a fallback is active)."""
        return self.policy_id

    async def start(self) -> None:  # noqa: B027
        """Start background work (Redis probes)."""

    async def close(self) -> None:  # noqa: B027
        """Stop background work; idempotent."""


def rendezvous_rank(key: bytes, worker_id: str) -> int:
    """Highest-random-weight hash: the same key ranks workers the same way on every router."""
    return int.from_bytes(hashlib.blake2b(key + b"\x00" + worker_id.encode(), digest_size=8).digest(), "little")
