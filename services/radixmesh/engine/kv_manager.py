"""Ties requests to KV memory: prefix matching, slot allocation with eviction, caching on release.

Invariant: every KV slot is in exactly one place: the allocator's free list, the
radix tree, or a live request's row beyond its locked prefix.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixmesh.engine.memory import KVSlotAllocator, ReqToTokenPool, TokenToKVPool
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.request import Req


class KVCacheManager:
    before_release: Callable[[Req], None] | None = None
    """Called first by `release` (a decode step on another CUDA stream may still use the request's slots and row:
    scheduler/decode_stream.py)."""

    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool, allocator: KVSlotAllocator,
                 tree: RadixCache) -> None:
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.allocator = allocator
        self.tree = tree
        self.capacity = kv_pool.size

    # ---- accounting -------------------------------------------------------------------------
    def available_tokens(self, rank: int | None = None) -> int:
        """Slots a new allocation can get: free now plus evictable from the tree (`rank`: of that data-parallel
        attention rank's pool; one pool here)."""
        return self.allocator.available_size() + self.tree.evictable_size()

    @property
    def rank_capacity(self) -> int:
        """Slots of the pool one request's KV lives in (all of them here)."""
        return self.capacity

    def rank_of(self, req: Req) -> int:
        """The pool (data-parallel attention rank) `req`'s KV lives in: 0, the only one here."""
        return 0

    def short_rank(self, reqs: list[Req]) -> int | None:
        """A pool that cannot give each of `reqs` in it one slot (decode), or None."""
        return 0 if reqs and self.available_tokens() < len(reqs) else None

    def extra_stats(self) -> dict[str, object]:
        """Figures of this manager beyond the scheduler's own (none here)."""
        return {}

    def used_tokens(self) -> int:
        """Slots held by live requests or locked in the tree (not free, not evictable)."""
        return self.capacity - self.available_tokens()

    # ---- admission --------------------------------------------------------------------------
    def match(self, req: Req) -> None:
        """Find a waiting request's cached prefix (at most `req.max_prefix_len` tokens), without locking it.

        Only eviction can invalidate the match, and nothing evicts before admission locks it.
        """
        assert req.last_node is None, "a waiting request must not hold a lock"
        match = self.tree.match_prefix(req.cache_key(req.all_ids[: req.max_prefix_len]))
        req.prefix_indices = match.indices
        req.matched_node = match.last_node

    def lock(self, req: Req) -> None:
        """Protect the matched prefix from eviction while the request holds it."""
        assert req.matched_node is not None, "lock() needs a match() first"
        req.last_node, req.matched_node = req.matched_node, None
        self.tree.inc_lock_ref(req.last_node)

    def unlock(self, req: Req) -> None:
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
            req.last_node = None

    def alloc_slots(self, num_tokens: int) -> torch.Tensor | None:
        """`num_tokens` free slots, evicting unlocked cache leaves if needed; None if impossible."""
        if num_tokens == 0:
            return torch.empty(0, dtype=torch.int64, device=self.kv_pool.device)
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.tree.evict(short)
        return self.allocator.alloc(num_tokens)

    def alloc_for(self, reqs: list[Req], counts: list[int]) -> torch.Tensor | None:
        """`counts[i]` slots for each of `reqs`, concatenated in order; None (nothing taken) if impossible."""
        return self.alloc_slots(sum(counts))

    def assign_row(self, req: Req) -> bool:
        """Give the request a row in req_to_token holding its locked prefix."""
        if req.req_pool_idx is None:
            rows = self.req_pool.alloc(1)
            if rows is None:
                return False
            req.req_pool_idx = rows[0]
        prefix_len = len(req.prefix_indices)
        if prefix_len:
            self.req_pool.write(req.req_pool_idx, 0, req.prefix_indices)
        req.kv_len = prefix_len
        return True

    # ---- release ----------------------------------------------------------------------------
    def cache_unfinished(self, req: Req) -> None:
        """Hand the request's computed KV to the tree and re-lock it as the new prefix (chunking)."""
        assert req.req_pool_idx is not None, "request has no KV row"
        tokens = req.cache_key(req.all_ids[: req.kv_len])
        row = self.req_pool.req_to_token[req.req_pool_idx]
        self._insert(req, tokens, row[: req.kv_len])
        self.unlock(req)
        match = self.tree.match_prefix(tokens)
        assert len(match.indices) == req.kv_len, "tree lost tokens it was just given"
        self.req_pool.write(req.req_pool_idx, 0, match.indices)
        req.prefix_indices = match.indices
        req.last_node = match.last_node
        self.tree.inc_lock_ref(match.last_node)

    def release(self, req: Req) -> None:
        """Request done, aborted or retracted: its KV goes to the tree (evictable), its row is freed."""
        if self.before_release is not None:
            self.before_release(req)
        if req.req_pool_idx is None:
            self.unlock(req)
            return
        row = self.req_pool.req_to_token[req.req_pool_idx]
        self._insert(req, req.cache_key(req.all_ids[: req.kv_len]), row[: req.kv_len])
        self.unlock(req)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.kv_len = 0

    def _insert(self, req: Req, tokens: list[int], slots: torch.Tensor) -> None:
        prefix_len = len(req.prefix_indices)
        slots = slots.clone()
        shared_len = self.tree.insert(tokens, slots)
        # [prefix_len, shared_len): the tree already had these tokens in other slots; ours are copies
        if shared_len > prefix_len:
            self.allocator.free(slots[prefix_len:shared_len])

    def flush(self) -> bool:
        """Drop the whole prefix cache; only when no request holds KV."""
        if self.tree.protected_size() > 0 or self.req_pool.available_size() != self.req_pool.size:
            return False
        self.tree.reset()
        return True
