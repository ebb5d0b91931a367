"""HiRadixCache: a radix tree whose nodes live in the device pool, the host tier, or both.

A node evicted from the device pool keeps its place in the tree with its KV in host memory
(`on_device=False`); a later match finds it there and the scheduler loads it back instead of
recomputing it. Nodes leave the tree only when they are evicted from the host tier (LRU over
host-only leaves), or when the device evicts a node that the host has no room for.

Invariants, on top of RadixCache's:

- if a node is off the device, so is every descendant: device eviction takes only nodes whose
  children are all off the device, and loads and inserts bring a whole path back, top down;
- `evictable_size`/`protected_size` count device tokens only (a host-only node holds no slot);
- every device slot is free, owned by exactly one on-device node, or owned by a request; every
  host slot is free or owned by exactly one node's `host_value`;
- a node being loaded (`loading`) is locked and is never split or evicted until its load finished.

Write policies: `write-through` copies every new node to the host at the next `flush_backups`
(eviction then only frees device slots); `write-back` copies a node when the device evicts it.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

import torch

from radixmesh.engine.hicache.host_pool import HostKVPool
from radixmesh.engine.hicache.transfer import HostTransfer, TransferOp
from radixmesh.engine.memory import KVSlotAllocator
from radixmesh.engine.radix_cache import CacheListener, MatchResult, RadixCache, TreeNode, _now, common_prefix_len

DEVICE, HOST = "device", "host"


@dataclass
class HostMatch:
    """The longest cached prefix of a key across both tiers."""

    device: MatchResult
    """The on-device part (what `match_prefix` returns)."""
    host_nodes: list[TreeNode] = field(default_factory=list)
    """Off-device nodes after `device.last_node`, in path order, none of them loading."""
    host_len: int = 0
    """Tokens in `host_nodes`."""
    loading_node: TreeNode | None = None
    """A node on the path whose load is in flight (the walk stopped there: match again once it is done)."""

    @property
    def last_node(self) -> TreeNode:
        """The deepest node of the match (lock it to protect the whole path)."""
        if self.loading_node is not None:
            return self.loading_node
        return self.host_nodes[-1] if self.host_nodes else self.device.last_node


@dataclass
class _Load:
    op: TransferOp
    nodes: list[TreeNode]


class HiRadixCache(RadixCache):
    """RadixCache over a device pool and a host tier (see the module docstring)."""

    def __init__(self, allocator: KVSlotAllocator, host_pool: HostKVPool, transfer: HostTransfer,
                 write_through: bool, listener: CacheListener | None = None) -> None:
        super().__init__(allocator, listener=listener)
        self.host_pool = host_pool
        self.host_allocator = host_pool.allocator
        self.transfer = transfer
        self.write_through = write_through
        self.loading: set[TreeNode] = set()
        self.loads: list[_Load] = []
        self.writes: list[TransferOp] = []
        self._to_backup: list[TreeNode] = []
        self.counters = {"hicache_num_writes": 0, "hicache_write_tokens": 0, "hicache_write_bytes": 0,
                         "hicache_num_loads": 0, "hicache_load_tokens": 0, "hicache_load_bytes": 0,
                         "hicache_load_s_total": 0.0, "hicache_write_s_total": 0.0,
                         "hicache_offloaded_tokens": 0, "hicache_host_evicted_tokens": 0,
                         "hicache_dropped_tokens": 0}

    # ---- matching -------------------------------------------------------------------------------
    def match_prefix(self, key: list[int]) -> MatchResult:
        """The longest on-device prefix (stops at the first off-device node); marks it recently used."""
        now = _now()
        node = self.root
        node.last_access_time = now
        pieces: list[torch.Tensor] = []
        i = 0
        while i < len(key) and key[i] in node.children:
            child = node.children[key[i]]
            if not child.on_device:
                break
            matched = common_prefix_len(child.key, key, i)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access_time = now
            pieces.append(child.value)
            node = child
            i += matched
        return MatchResult(torch.cat(pieces) if pieces else self._empty(), node)

    def match_host(self, key: list[int]) -> HostMatch:
        """`match_prefix`, then the off-device nodes that continue it (split to end at the match)."""
        device = self.match_prefix(key)
        result = HostMatch(device)
        node, i, now = device.last_node, len(device.indices), _now()
        while i < len(key) and key[i] in node.children:
            child = node.children[key[i]]
            if child in self.loading:
                result.loading_node = child
                break
            matched = common_prefix_len(child.key, key, i)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access_time = now
            result.host_nodes.append(child)
            result.host_len += matched
            node = child
            i += matched
        return result

    # ---- insert and locks -----------------------------------------------------------------------
    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """RadixCache.insert; off-device nodes on the path take the caller's slots for their tokens (their
        host copy stays), so the return value is the length of the path that was on the device before."""
        assert value.dim() == 1 and value.numel() == len(key), (
            f"value shape {tuple(value.shape)} does not match key length {len(key)}")
        now = _now()
        node = self.root
        node.last_access_time = now
        i, device_len = 0, -1
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                self._add_leaf(node, key[i:], value[i:], now)
                break
            if child in self.loading:
                self.complete_loads(wait=True)  # rare: a request computed what is being loaded
            matched = common_prefix_len(child.key, key, i)
            if matched < len(child.key):
                child = self._split(child, matched)
            if not child.on_device:
                device_len = i if device_len < 0 else device_len
                self._to_device(child, value[i:i + matched].to(device=self.device, dtype=torch.int64).clone())
            child.last_access_time = now
            node = child
            i += matched
        return i if device_len < 0 else device_len

    # ---- device eviction ------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free device slots of unlocked device leaves, LRU first: each moves to the host tier (written
        there now unless it has a copy already), or leaves the tree when the host has no room."""
        if num_tokens <= 0:
            return 0
        tie = itertools.count()
        heap = [(n.last_access_time, next(tie), n) for n in self._all_nodes() if self._is_device_leaf(n)]
        heapq.heapify(heap)
        freed, to_free = 0, []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            slots = node.value
            if node.host_value is None:
                node.host_value = self._alloc_host(len(node.key), copies)
                if node.host_value is not None:
                    copies.append((slots, node.host_value))
            freed += len(node.key)
            to_free.append(slots)
            parent = node.parent
            if node.host_value is not None:
                self._to_host(node)
            else:
                self._drop(node)
            if parent is not None and self._is_device_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, next(tie), parent))
        self._write(copies)
        for slots in to_free:
            self.allocator.free(slots)
        return freed

    def _is_device_leaf(self, node: TreeNode) -> bool:
        return (node is not self.root and node.on_device and node.lock_ref == 0
                and not any(child.on_device for child in node.children.values()))

    def _to_host(self, node: TreeNode) -> None:
        assert node.lock_ref == 0 and node.host_value is not None, "offloading a locked or unbacked node"
        node.on_device = False
        node.value = self._empty()
        self._evictable_size -= len(node.key)
        self.counters["hicache_offloaded_tokens"] += len(node.key)
        self._tell_tier(node, HOST)

    def _to_device(self, node: TreeNode, slots: torch.Tensor) -> None:
        node.value = slots
        node.on_device = True
        if node.lock_ref > 0:
            self._protected_size += len(node.key)
        else:
            self._evictable_size += len(node.key)
        self._tell_tier(node, DEVICE)

    def _drop(self, node: TreeNode) -> None:
        """Remove an unlocked node and its (off-device) subtree; the caller frees the node's device slots."""
        for child in list(node.children.values()):
            assert not child.on_device, "dropping a node with a child on the device"
            self._drop(child)
        if self.listener is not None:
            self.listener.on_evict(node)
        self._free_host_copy(node)
        if node.on_device:
            self._evictable_size -= len(node.key)
            self.counters["hicache_dropped_tokens"] += len(node.key)
        else:
            self.counters["hicache_host_evicted_tokens"] += len(node.key)
        parent = node.parent
        assert parent is not None and node.lock_ref == 0, "dropping a locked node"
        del parent.children[node.key[0]]

    # ---- the host tier --------------------------------------------------------------------------
    def _alloc_host(self, num: int, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """Host slots for `num` tokens, evicting from the host if needed. The `copies` queued so far are
        enqueued first: once their writes are on the copy stream, their slots may be evicted and reused."""
        short = num - self.host_allocator.available_size()
        if short > 0:
            self._write(copies)
            copies.clear()
            self.evict_host(short)
        return self.host_allocator.alloc(num)

    def evict_host(self, num_tokens: int) -> int:
        """Free host slots, LRU first: host-only leaves leave the tree; then device nodes lose their host copy."""
        tie = itertools.count()
        heap = [(n.last_access_time, next(tie), n) for n in self._all_nodes() if self._is_host_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            freed += len(node.key)
            parent = node.parent
            self._drop(node)
            if parent is not None and self._is_host_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, next(tie), parent))
        if freed < num_tokens:
            backed = sorted((n for n in self._all_nodes() if n.on_device and n.host_value is not None),
                            key=lambda n: n.last_access_time)
            for node in backed:
                if freed >= num_tokens:
                    break
                freed += len(node.key)
                self._free_host_copy(node)
        return freed

    def _is_host_leaf(self, node: TreeNode) -> bool:
        return (node is not self.root and not node.on_device and not node.children and node.lock_ref == 0
                and node not in self.loading)

    def _free_host_copy(self, node: TreeNode) -> None:
        if node.host_value is not None:
            self.host_allocator.free(node.host_value)
            node.host_value = None

    def _write(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Enqueue one write of (device slots, host slots) pairs (nothing when empty)."""
        if not copies:
            return
        op = self.transfer.write(torch.cat([d for d, _ in copies]), torch.cat([h for _, h in copies]))
        self.writes.append(op)
        self.counters["hicache_num_writes"] += 1
        self.counters["hicache_write_tokens"] += op.num_tokens
        self.counters["hicache_write_bytes"] += op.num_bytes

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor, now: float) -> None:
        super()._add_leaf(parent, key, value, now)
        if self.write_through:
            self._to_backup.append(parent.children[key[0]])

    def flush_backups(self) -> int:
        """write-through: copy nodes added since the last flush (and ancestors split off them) to the host."""
        pending, self._to_backup = self._to_backup, []
        batch: list[TreeNode] = []
        seen: set[TreeNode] = set()
        for node in pending:
            if not self._in_tree(node):
                continue
            current: TreeNode | None = node
            while (current is not None and current is not self.root and current.on_device
                   and current.host_value is None and current not in seen):
                seen.add(current)
                batch.append(current)
                current = current.parent
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        written = 0
        for node in batch:
            host = self._alloc_host(len(node.key), copies)
            if host is None:
                break  # the host is full of locked nodes: these get written at eviction, if at all
            node.host_value = host
            copies.append((node.value, host))
            written += len(node.key)
        self._write(copies)
        return written

    def _in_tree(self, node: TreeNode) -> bool:
        parent = node.parent
        return parent is not None and bool(node.key) and parent.children.get(node.key[0]) is node

    # ---- loads ----------------------------------------------------------------------------------
    def start_load(self, nodes: list[TreeNode], device_slots: torch.Tensor) -> None:
        """Copy the host KV of `nodes` (off-device, in path order, locked by the caller) into `device_slots`."""
        assert sum(len(n.key) for n in nodes) == device_slots.numel(), "device slots do not match the nodes"
        for node in nodes:
            assert not node.on_device and node.host_value is not None and node not in self.loading, (
                "loading a node that is on the device, has no host copy or is loading already")
            assert node.lock_ref > 0, "a node must be locked while it loads"
        op = self.transfer.load(torch.cat([n.host_value for n in nodes if n.host_value is not None]), device_slots)
        self.loading.update(nodes)
        self.loads.append(_Load(op, nodes))
        self.counters["hicache_num_loads"] += 1
        self.counters["hicache_load_tokens"] += op.num_tokens
        self.counters["hicache_load_bytes"] += op.num_bytes

    def complete_loads(self, wait: bool = False) -> int:
        """Bring the nodes of finished loads onto the device (all loads when `wait`); returns how many finished."""
        finished, pending = 0, []
        for load in self.loads:
            if not wait and not load.op.done():
                pending.append(load)
                continue
            load.op.wait()
            self.transfer.finish(load.op)
            assert load.op.device_slots is not None
            offset = 0
            for node in load.nodes:
                self.loading.discard(node)
                self._to_device(node, load.op.device_slots[offset:offset + len(node.key)])
                offset += len(node.key)
            self.counters["hicache_load_s_total"] += (load.op.done_s or time.perf_counter()) - load.op.started_s
            finished += 1
        self.loads = pending
        return finished

    def complete_writes(self, wait: bool = False) -> None:
        """Release the staging buffers of finished writes (all of them when `wait`)."""
        pending = []
        for op in self.writes:
            if wait or op.done():
                op.wait()
                self.transfer.finish(op)
                self.counters["hicache_write_s_total"] += (op.done_s or time.perf_counter()) - op.started_s
            else:
                pending.append(op)
        self.writes = pending

    # ---- whole tree -----------------------------------------------------------------------------
    def reset(self) -> None:
        self.complete_loads(wait=True)
        self.complete_writes(wait=True)
        self._to_backup = []
        super().reset()
        self.host_allocator.clear()

    def total_size(self) -> int:
        """Tokens on the device, counted by walking the tree."""
        return sum(len(n.key) for n in self._all_nodes() if n.on_device)

    def host_size(self) -> int:
        """Tokens with a host copy (host-only or both), counted by walking the tree."""
        return sum(len(n.key) for n in self._all_nodes() if n.host_value is not None)

    def _tell_tier(self, node: TreeNode, tier: str) -> None:
        if self.listener is not None:
            self.listener.on_tier(node, tier)
