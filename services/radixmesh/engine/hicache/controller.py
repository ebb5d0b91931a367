"""The scheduler's side of the hierarchical cache: loads for waiting requests, and holds until admission.

Once per step (`tick`, before scheduling) the controller

1. brings finished loads onto the device and frees the staging of finished writes;
2. releases the holds of requests that left the queue (admitted, aborted), and of requests whose
   load finished long ago but that still cannot be admitted (their KV stays cached, unlocked);
3. write-through: copies the nodes added since the last step to the host;
4. matches the oldest waiting requests across both tiers and, for a host hit of at least
   `MIN_LOAD_TOKENS` that fits the KV budget, locks the path, allocates device slots and starts the
   load (or joins a load already in flight for the same path).

A request whose prefix is loading is left out of admission (`ready`) until the load is done; others
are scheduled meanwhile, so a load never blocks them. Its hold keeps the loaded KV locked until the
request's own admission locks it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from radixmesh.engine.hicache.tree import HiRadixCache
from radixmesh.engine.kv_manager import KVCacheManager
from radixmesh.engine.radix_cache import TreeNode
from radixmesh.engine.request import Req

MIN_LOAD_TOKENS = 16
"""Shorter host hits are recomputed with the rest of the prompt: not worth a step of waiting."""
MAX_HOLD_TICKS = 200
"""A hold whose load finished this many steps ago is released if its request is still not admitted."""
IDLE_POLL_S = 0.0005


@dataclass
class _Hold:
    req: Req
    node: TreeNode
    """The deepest node of the loaded path, locked until the request leaves the queue."""
    num_tokens: int
    """Host-tier tokens the request reuses."""
    need: int
    """KV the request still needs beyond its prefix (its uncached part plus its decode reserve)."""
    started_s: float = field(default_factory=time.time)
    ticks_done: int = 0


class HiCacheController:
    def __init__(self, kv: KVCacheManager, tree: HiRadixCache, window: int) -> None:
        self.kv = kv
        self.tree = tree
        self.window = window
        """Waiting requests matched against the host tier per step (the oldest ones)."""
        self.holds: dict[str, _Hold] = {}
        self.num_host_hit_tokens = 0
        self.num_hold_timeouts = 0

    @property
    def busy(self) -> bool:
        """Loads in flight or requests held: the scheduler must keep stepping."""
        return bool(self.holds or self.tree.loads)

    @property
    def loading(self) -> bool:
        return bool(self.tree.loads)

    def tick(self, waiting: list[Req], running: list[Req], ratio: float) -> None:
        """Once per scheduler step, before scheduling (see the module docstring)."""
        self.tree.complete_loads()
        self.tree.complete_writes()
        self._release_holds({r.rid for r in waiting})
        self.tree.flush_backups()
        if waiting:
            self._start_loads(waiting[: self.window], running, ratio)

    def ready(self, waiting: list[Req]) -> list[Req]:
        """The waiting requests admission may take now: all but those whose prefix is loading."""
        if not self.tree.loading:
            return waiting
        return [r for r in waiting if not self._is_loading(r)]

    def wait(self, timeout_s: float) -> None:
        """Nothing else to run: wait (up to `timeout_s`) for a load to finish."""
        deadline = time.perf_counter() + timeout_s
        while self.tree.loads and not any(load.op.done() for load in self.tree.loads):
            if time.perf_counter() > deadline:
                return
            time.sleep(IDLE_POLL_S)

    def _is_loading(self, req: Req) -> bool:
        hold = self.holds.get(req.rid)
        return hold is not None and hold.node in self.tree.loading

    # ---- holds ----------------------------------------------------------------------------------
    def _release_holds(self, waiting_ids: set[str]) -> None:
        for rid, hold in list(self.holds.items()):
            if hold.node not in self.tree.loading:
                hold.ticks_done += 1
                if hold.req.host_load is None and hold.num_tokens:
                    hold.req.host_load = (hold.started_s, time.time(), hold.num_tokens)
            timed_out = hold.ticks_done > MAX_HOLD_TICKS
            if rid not in waiting_ids or timed_out:
                if rid in waiting_ids:
                    self.num_hold_timeouts += 1
                self.tree.dec_lock_ref(hold.node)
                del self.holds[rid]

    def _held_need(self) -> int:
        return sum(h.need for h in self.holds.values())

    # ---- loads ----------------------------------------------------------------------------------
    def _start_loads(self, candidates: list[Req], running: list[Req], ratio: float) -> None:
        reserved = sum(math.ceil(ratio * r.remaining_new_tokens) for r in running) + self._held_need()
        for req in candidates:
            if req.rid in self.holds:
                continue
            match = self.tree.match_host(req.all_ids[: req.max_prefix_len])
            device_len = len(match.device.indices)
            if match.loading_node is not None:  # another request's load covers this path: wait for it too
                tokens = _depth(match.loading_node) - device_len
                self._hold(req, match.loading_node, tokens, 0)
                continue
            if match.host_len < MIN_LOAD_TOKENS:
                continue
            rest = req.fill_len - device_len - match.host_len + math.ceil(ratio * req.remaining_new_tokens)
            if self.kv.available_tokens() - reserved < match.host_len + rest:
                continue  # no room now: it is loaded at a later step, or admitted and recomputed
            node = match.host_nodes[-1]
            self.tree.inc_lock_ref(node)  # before allocating: eviction must not take the device prefix
            slots = self.kv.alloc_slots(match.host_len)
            if slots is None:
                self.tree.dec_lock_ref(node)
                continue
            self.tree.start_load(match.host_nodes, slots)
            self.holds[req.rid] = _Hold(req, node, match.host_len, rest)
            self.num_host_hit_tokens += match.host_len
            reserved += rest

    def _hold(self, req: Req, node: TreeNode, num_tokens: int, need: int) -> None:
        self.tree.inc_lock_ref(node)
        self.holds[req.rid] = _Hold(req, node, num_tokens, need)
        self.num_host_hit_tokens += num_tokens

    # ---- introspection --------------------------------------------------------------------------
    def stats(self) -> dict[str, float | int]:
        tree = self.tree
        host = tree.host_pool
        return {**tree.counters,
                "hicache_host_capacity_tokens": host.size,
                "hicache_host_free_tokens": host.allocator.available_size(),
                "hicache_host_tokens": tree.host_size(),
                "hicache_host_hit_tokens": self.num_host_hit_tokens,
                "hicache_loads_in_flight": len(tree.loads),
                "hicache_writes_in_flight": len(tree.writes),
                "hicache_num_holds": len(self.holds),
                "hicache_num_hold_timeouts": self.num_hold_timeouts}


def _depth(node: TreeNode) -> int:
    """Tokens on the path from the root to the end of `node`."""
    depth = 0
    current: TreeNode | None = node
    while current is not None and current.parent is not None:
        depth += len(current.key)
        current = current.parent
    return depth
