"""KV memory under data-parallel attention: one pool per rank, one slot numbering, one radix tree on rank 0.

Each rank's pool holds `rank_size` slots of whole-model KV (slot 0 is its dummy). Rank 0 schedules every rank's
requests, so it numbers all slots in one space: slot `l` of rank `r` is `r * (rank_size + 1) + l`, and a rank
reads its own slots back as `slot % (rank_size + 1)`. A request lives on one rank from its first admission on
(`Req.dp_rank`): its KV, its cached prefixes (its keys carry the rank as their radix-tree namespace, so a prefix
is shared only by requests of the same rank) and its decode slots all come from that rank's pool.

Invariant, per rank: every slot is in the rank's free list, in the tree under the rank's namespace, or in a live
request of the rank beyond its locked prefix.
"""

from __future__ import annotations

import torch

from radixmesh.engine.kv_manager import KVCacheManager
from radixmesh.engine.memory import KVSlotAllocator, ReqToTokenPool, TokenToKVPool
from radixmesh.engine.radix_cache import RadixCache, TreeNode
from radixmesh.engine.request import Req
from radixmesh.wire.lora import TOKEN_BITS


class DpSlotAllocator(KVSlotAllocator):
    """Free lists of `num_ranks` pools of `rank_size` slots, over the one numbering of the module docstring."""

    def __init__(self, rank_size: int, num_ranks: int, device: str | torch.device) -> None:  # no free list of its own
        assert num_ranks > 1, f"a data-parallel allocator over {num_ranks} ranks"
        self.rank_size, self.num_ranks = rank_size, num_ranks
        self.size = rank_size * num_ranks
        self.device = torch.device(device)
        self.ranks = [KVSlotAllocator(rank_size, device) for _ in range(num_ranks)]

    @property
    def stride(self) -> int:
        """Slot numbers per rank (its pool and its dummy slot 0)."""
        return self.rank_size + 1

    def alloc(self, n: int, rank: int = 0) -> torch.Tensor | None:
        """`n` slots of rank `rank`'s pool (in the global numbering); None (nothing taken) if fewer are free."""
        local = self.ranks[rank].alloc(n)
        return None if local is None else local + rank * self.stride

    def free(self, slots: torch.Tensor) -> None:
        """Return slots of any ranks (each to its own rank's free list)."""
        if slots.numel() == 0:
            return
        slots = slots.reshape(-1).to(device=self.device, dtype=torch.int64)
        owner = slots // self.stride
        for rank, allocator in enumerate(self.ranks):
            mine = slots[owner == rank]
            if mine.numel():
                allocator.free(mine - rank * self.stride)

    def available_size(self, rank: int | None = None) -> int:
        """Free slots of rank `rank` (None: of all ranks)."""
        if rank is not None:
            return self.ranks[rank].available_size()
        return sum(a.available_size() for a in self.ranks)

    def clear(self) -> None:
        for allocator in self.ranks:
            allocator.clear()


def rank_of_key(key: list[int]) -> int:
    """The rank of a radix-tree path: its namespace (rank 0's keys carry none)."""
    return key[0] >> TOKEN_BITS


class DpRadixCache(RadixCache):
    """A radix tree whose paths each belong to one rank (their namespace), with each rank's evictable size."""

    def __init__(self, allocator: DpSlotAllocator, disable: bool = False) -> None:
        self.rank_evictable = [0] * allocator.num_ranks
        """Tokens of unlocked nodes per rank (what an eviction in that rank's pool can free)."""
        super().__init__(allocator, disable)

    def reset(self) -> None:
        super().reset()
        self.rank_evictable = [0] * len(self.rank_evictable)

    def evict(self, num_tokens: int, rank: int | None = None) -> int:
        """`RadixCache.evict` within rank `rank`'s paths (None: any)."""
        if rank is None:
            return super().evict(num_tokens)
        return self._evict_where(num_tokens, lambda leaf: rank_of_key(leaf.key) == rank)

    def inc_lock_ref(self, node: TreeNode) -> int:
        moved = super().inc_lock_ref(node)
        if moved:
            self.rank_evictable[rank_of_key(node.key)] -= moved
        return moved

    def dec_lock_ref(self, node: TreeNode) -> int:
        moved = super().dec_lock_ref(node)
        if moved:
            self.rank_evictable[rank_of_key(node.key)] += moved
        return moved

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor, now: float) -> None:
        super()._add_leaf(parent, key, value, now)
        self.rank_evictable[rank_of_key(key)] += len(key)

    def _remove_leaf(self, leaf: TreeNode) -> TreeNode:
        self.rank_evictable[rank_of_key(leaf.key)] -= len(leaf.key)
        return super()._remove_leaf(leaf)


class DpKVCacheManager(KVCacheManager):
    """`KVCacheManager` over one pool per data-parallel attention rank: each request is given a rank at its first
    match (the rank with the fewest live requests; among those, the longest cached prefix) and keeps it."""

    allocator: DpSlotAllocator
    tree: DpRadixCache

    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool, allocator: DpSlotAllocator,
                 tree: DpRadixCache) -> None:
        super().__init__(req_pool, kv_pool, allocator, tree)
        self.num_ranks = allocator.num_ranks
        self.capacity = allocator.size
        self._live: dict[int, int] = {}
        """id(request) -> its rank, for requests given a rank and not finished (the load `assign` balances)."""

    @classmethod
    def over(cls, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool, allocator: KVSlotAllocator,
             disable_cache: bool) -> DpKVCacheManager:
        assert isinstance(allocator, DpSlotAllocator), "data-parallel attention needs the per-rank allocator"
        return cls(req_pool, kv_pool, allocator, DpRadixCache(allocator, disable_cache))

    # ---- ranks ------------------------------------------------------------------------------
    @property
    def rank_capacity(self) -> int:
        return self.allocator.rank_size

    def rank_of(self, req: Req) -> int:
        assert req.dp_rank >= 0, f"request {req.rid} has no data-parallel rank yet (match it first)"
        return req.dp_rank

    def assign(self, req: Req) -> None:
        """Give `req` its rank (see the class docstring) and the radix-tree namespace of that rank."""
        load = [0] * self.num_ranks
        for rank in self._live.values():
            load[rank] += 1
        least = min(load)
        candidates = [r for r in range(self.num_ranks) if load[r] == least]
        if len(candidates) > 1 and not self.tree.disable:
            ids = req.all_ids[: req.max_prefix_len]
            candidates.sort(key=lambda r: -len(self.tree.match_prefix(_namespaced(ids, r)).indices))
        req.dp_rank = candidates[0]
        req.cache_namespace = req.dp_rank
        self._live[id(req)] = req.dp_rank

    def match(self, req: Req) -> None:
        if req.dp_rank < 0:
            self.assign(req)
        super().match(req)

    # ---- accounting -------------------------------------------------------------------------
    def available_tokens(self, rank: int | None = None) -> int:
        if rank is None:
            return super().available_tokens()
        return self.allocator.available_size(rank) + self.tree.rank_evictable[rank]

    def short_rank(self, reqs: list[Req]) -> int | None:
        counts = [0] * self.num_ranks
        for req in reqs:
            counts[self.rank_of(req)] += 1
        return next((r for r in range(self.num_ranks) if counts[r] and self.available_tokens(r) < counts[r]), None)

    def rank_stats(self) -> list[dict[str, int]]:
        """Per rank: slots free, cached in the tree (evictable) and live requests."""
        live = [0] * self.num_ranks
        for rank in self._live.values():
            live[rank] += 1
        return [{"free": self.allocator.available_size(r), "evictable": self.tree.rank_evictable[r],
                 "live_requests": live[r]} for r in range(self.num_ranks)]

    def extra_stats(self) -> dict[str, object]:
        return {"dp_attention_size": self.num_ranks, "dp_rank_kv": self.rank_stats()}

    # ---- allocation -------------------------------------------------------------------------
    def alloc_slots(self, num_tokens: int, rank: int = 0) -> torch.Tensor | None:
        """`num_tokens` free slots of rank `rank`'s pool, evicting that rank's unlocked leaves if needed."""
        if num_tokens == 0:
            return torch.empty(0, dtype=torch.int64, device=self.kv_pool.device)
        short = num_tokens - self.allocator.available_size(rank)
        if short > 0:
            self.tree.evict(short, rank)
        return self.allocator.alloc(num_tokens, rank)

    def alloc_for(self, reqs: list[Req], counts: list[int]) -> torch.Tensor | None:
        """Each request's slots from its rank's pool, concatenated in request order."""
        by_rank: dict[int, list[int]] = {}
        for i, req in enumerate(reqs):
            by_rank.setdefault(self.rank_of(req), []).append(i)
        pieces: list[torch.Tensor | None] = [None] * len(reqs)
        taken: list[torch.Tensor] = []
        for rank, members in by_rank.items():
            slots = self.alloc_slots(sum(counts[i] for i in members), rank)
            if slots is None:
                for done in taken:
                    self.allocator.free(done)
                return None
            taken.append(slots)
            for i, part in zip(members, slots.split([counts[i] for i in members]), strict=True):
                pieces[i] = part
        parts = [p for p in pieces if p is not None]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=self.kv_pool.device)

    def release(self, req: Req) -> None:
        super().release(req)
        if req.finished:
            self._live.pop(id(req), None)


def _namespaced(ids: list[int], rank: int) -> list[int]:
    from radixmesh.wire.lora import namespaced

    return namespaced(ids, rank)
