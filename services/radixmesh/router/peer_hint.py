"""Prefix sharing: name a peer worker whose device holds more of the prompt than the chosen worker has.

After the policy picked worker B by cache and load, the index may show another worker A holding a
longer prefix of the prompt on its device (B was less loaded, say). When A holds at least
`min_tokens` more tokens than B holds in either tier, the router names A in the request
(`GenerateRequest.peer_prefix`, with the epoch of A's index entries); B then decides, by its own
measured rates, whether to fetch that KV from A or compute it (worker/peer_fetch.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from radixmesh.router.policies.base import RouteRequest, RoutingDecision
from radixmesh.router.workers import WorkerHandle


@dataclass(frozen=True)
class PeerHint:
    """A worker holding a longer device prefix of the prompt than the chosen one."""

    worker: WorkerHandle
    num_tokens: int
    """Leading prompt tokens it holds on its device (whole blocks)."""
    epoch: int
    """Epoch of its index entries (0: unknown)."""


def plan_peer(request: RouteRequest, decision: RoutingDecision, candidates: Sequence[WorkerHandle],
              device_blocks: Mapping[str, int], epochs: Mapping[str, int], min_tokens: int) -> PeerHint | None:
    """The candidate with the longest device prefix, when it beats the chosen worker by `min_tokens` (0: off).

    `device_blocks` and `epochs` are keyed by worker_id; at least one prompt token is always left for the
    chosen worker to compute.
    """
    chosen = decision.worker
    if min_tokens <= 0 or len(candidates) < 2:
        return None
    held = decision.cached_tokens.get(chosen.worker_id, 0)
    best: tuple[int, WorkerHandle] | None = None
    for worker in candidates:
        if worker is chosen:
            continue
        tokens = min(device_blocks.get(worker.worker_id, 0) * request.block_size, request.num_prompt_tokens - 1)
        if best is None or tokens > best[0]:
            best = (tokens, worker)
    if best is None or best[0] - held < min_tokens:
        return None
    tokens, worker = best
    return PeerHint(worker, tokens, epochs.get(worker.worker_id, 0))
