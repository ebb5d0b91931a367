"""Which waiting requests join the next prefill pass, and how KV is reserved for them.

Policies: `fcfs` (arrival order), `lpm` (longest cached prefix first) and `dfs-weight`
(dfs_weight.py). The two prefix-aware ones also hold back a request whose uncached prefix
another admitted request is about to compute (prefix_sharing.py).

Admission is optimistic: a running request is assumed to need only
`new_token_ratio * remaining max_new_tokens` more slots. The ratio decays while
decoding goes well and jumps back up when decode runs out of KV and retracts.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from radixmesh.engine.config import EngineConfig
from radixmesh.engine.kv_manager import KVCacheManager
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.dfs_weight import dfs_weight_order
from radixmesh.engine.scheduler.prefix_sharing import defer_shared_prefixes


def longest_prefix_first(reqs: list[Req]) -> list[Req]:
    """Longest cached prefix first, so requests sharing a prefix run while it is hot (stable)."""
    return sorted(reqs, key=lambda r: -len(r.prefix_indices))


PREFIX_ORDERS: dict[str, Callable[[list[Req]], list[Req]]] = {
    "lpm": longest_prefix_first,
    "dfs-weight": dfs_weight_order,
}
"""Policies that match waiting requests against the cache to order them; `fcfs` keeps arrival order."""


@dataclass
class WaitingOrder:
    """The waiting requests admission tries this step, in order."""

    reqs: list[Req]
    num_matched: int = 0
    """The first `num_matched` of `reqs` were matched against the cache this step; the rest are
    matched when admission reaches them."""
    deferred: list[Req] = field(default_factory=list)
    """Held back this step: a request in `reqs` (or the chunked prefill) computes their shared prefix."""


def order_waiting(queue: list[Req], config: EngineConfig, kv: KVCacheManager,
                  computing: Req | None = None) -> WaitingOrder:
    """Order the waiting queue by the policy; `computing` is a prompt being prefilled in chunks.

    Prefix-aware policies match and reorder only the oldest `schedule_policy_window` requests
    (the rest follow in arrival order), so their cost per step does not grow with the queue.
    """
    order_fn = PREFIX_ORDERS.get(config.schedule_policy)
    if order_fn is None or kv.tree.disable or not queue:
        return WaitingOrder(list(queue))
    window = queue[: config.schedule_policy_window]
    for req in window:
        kv.match(req)
    candidates, deferred = defer_shared_prefixes(order_fn(window), config.in_batch_prefix_threshold, computing)
    return WaitingOrder(candidates + queue[len(window):], len(candidates), deferred)


class PrefillAdder:
    """Greedy packing of requests into one prefill pass under token, row and KV budgets.

    The KV budget is read live (free + evictable slots, which shrinks as admitted
    prefixes get locked) less the decode reservation of running requests and
    what this pass has already planned.
    """

    def __init__(self, config: EngineConfig, kv: KVCacheManager, running: list[Req], ratio: float) -> None:
        self.kv = kv
        self.ratio = ratio
        self.token_budget = config.prefill_token_budget
        self.num_slots_left = config.max_running_requests - len(running)
        self.chunking = config.chunking_enabled
        self.reserved: Counter[int] = Counter()
        """Decode reserve of the running requests, per KV pool (data-parallel attention rank; one pool: 0)."""
        for req in running:
            self.reserved[kv.rank_of(req)] += self.decode_need(req)
        self.planned: Counter[int] = Counter()
        """Slots this pass has planned, per KV pool."""
        self.can_run: list[Req] = []
        self.chunked: Req | None = None

    def decode_need(self, req: Req) -> int:
        return math.ceil(self.ratio * req.remaining_new_tokens)

    def kv_budget(self, rank: int = 0) -> int:
        """Slots still free for this pass in pool `rank`."""
        return self.kv.available_tokens(rank) - self.reserved[rank] - self.planned[rank]

    def add_chunked(self, req: Req) -> None:
        """Continue a request whose prompt is being prefilled in chunks (its prefix is locked)."""
        remaining = req.fill_len - req.kv_len
        req.extend_len = min(remaining, self.token_budget, max(self.kv_budget(self.kv.rank_of(req)), 0))
        if req.extend_len == 0:
            self.chunked = req  # no room this round; decode frees or retracts first
            return
        req.is_chunked = req.extend_len < remaining
        self._take(req, self.decode_need(req) if not req.is_chunked else 0)
        if req.is_chunked:
            self.chunked = req

    def add_waiting(self, order: WaitingOrder) -> None:
        """Admit requests in order until one does not fit."""
        for i, req in enumerate(order.reqs):
            if i >= order.num_matched:
                self.kv.match(req)
            if not self.try_add(req):
                return

    def try_add(self, req: Req) -> bool:
        """Admit `req` if it fits; False means stop considering further requests."""
        if self.num_slots_left <= 0 or self.token_budget <= 0 or self.chunked is not None:
            return False
        self.kv.lock(req)
        extend_len = req.fill_len - len(req.prefix_indices)
        budget = self.kv_budget(self.kv.rank_of(req))
        fits_whole = extend_len + self.decode_need(req) <= budget
        if not fits_whole and (self.can_run or extend_len > budget):
            self.kv.unlock(req)
            return False
        req.is_chunked = False
        req.extend_len = extend_len
        if extend_len > self.token_budget and (self.chunking or self.can_run):
            if not self.chunking:
                self.kv.unlock(req)
                return False
            req.extend_len, req.is_chunked = self.token_budget, True
            self.chunked = req
        self.num_slots_left -= 1
        self._take(req, 0 if req.is_chunked else self.decode_need(req))
        return not req.is_chunked

    def _take(self, req: Req, decode_need: int) -> None:
        self.token_budget -= req.extend_len
        self.planned[self.kv.rank_of(req)] += req.extend_len + decode_need
        self.can_run.append(req)
