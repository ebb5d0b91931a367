"""Which waiting requests join the next prefill pass, and how KV is reserved for them.

Admission is optimistic: a running request is assumed to need only
`new_token_ratio * remaining max_new_tokens` more slots. The ratio decays while
decoding goes well and jumps back up when decode runs out of KV and retracts.
"""

from __future__ import annotations

import math

from radixmesh.engine.config import EngineConfig
from radixmesh.engine.kv_manager import KVCacheManager
from radixmesh.engine.request import Req


def order_waiting(queue: list[Req], policy: str, kv: KVCacheManager) -> list[Req]:
    """Match every waiting request's prefix and sort the queue by the policy."""
    for req in queue:
        kv.match(req)
    if policy == "lpm":
        # Longest cached prefix first, so requests sharing a prefix run while it is hot.
        return sorted(queue, key=lambda r: -len(r.prefix_indices))
    return list(queue)


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
        self.reserved = sum(self.decode_need(r) for r in running)
        self.planned = 0
        self.can_run: list[Req] = []
        self.chunked: Req | None = None

    def decode_need(self, req: Req) -> int:
        return math.ceil(self.ratio * req.remaining_new_tokens)

    def kv_budget(self) -> int:
        return self.kv.available_tokens() - self.reserved - self.planned

    def add_chunked(self, req: Req) -> None:
        """Continue a request whose prompt is being prefilled in chunks (its prefix is locked)."""
        remaining = req.fill_len - req.kv_len
        req.extend_len = min(remaining, self.token_budget, max(self.kv_budget(), 0))
        if req.extend_len == 0:
            self.chunked = req  # no room this round; decode frees or retracts first
            return
        req.is_chunked = req.extend_len < remaining
        self._take(req, self.decode_need(req) if not req.is_chunked else 0)
        if req.is_chunked:
            self.chunked = req

    def try_add(self, req: Req) -> bool:
        """Admit `req` if it fits; False means stop considering further requests."""
        if self.num_slots_left <= 0 or self.token_budget <= 0 or self.chunked is not None:
            return False
        self.kv.lock(req)
        extend_len = req.fill_len - len(req.prefix_indices)
        budget = self.kv_budget()
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
        self.planned += req.extend_len + decode_need
        self.can_run.append(req)
