"""Token-level radix tree of cached KV slots (RadixAttention, page size 1).

Each edge holds a run of token ids and the KV slots that hold their K/V. A request
shares the slots of its longest cached prefix instead of recomputing them; slots of
unlocked leaves are evicted least-recently-used first when the pool runs short.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from radixmesh.engine.memory import KVSlotAllocator

_clock = itertools.count()


def _now() -> float:
    """Strictly increasing access stamp, so LRU order has no ties between calls."""
    return float(next(_clock))


@dataclass(eq=False)
class TreeNode:
    """One edge of the tree and the node it leads to; compared by identity."""

    key: list[int] = field(default_factory=list)
    """Token ids on the edge into this node."""
    value: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    """KV slots of `key`, int64 [len(key)]."""
    parent: TreeNode | None = None
    children: dict[int, TreeNode] = field(default_factory=dict)
    """Children keyed by the first token of their key."""
    lock_ref: int = 0
    """Number of locks held on this node or a descendant; > 0 means never evicted."""
    last_access_time: float = field(default_factory=_now)
    on_device: bool = True
    """`value` holds the key's KV in the device pool; False: only the host tier has it (`value` is empty)."""
    host_value: torch.Tensor | None = None
    """Hierarchical cache: host-tier slots of `key` (CPU int64 [len(key)]); None when the host has no copy."""

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass
class MatchResult:
    """The longest cached prefix of a key."""

    indices: torch.Tensor
    """KV slots of the matched prefix, int64 [prefix_len] on the allocator's device."""
    last_node: TreeNode
    """Node whose path from the root is exactly the matched prefix (root if none)."""


class CacheListener(Protocol):
    """Told about every change to the set of cached token paths (e.g. to publish them to an index).

    A node's token path is the concatenation of the keys from the root down to it.
    """

    def on_insert(self, leaf: TreeNode) -> None:
        """A new leaf now caches its path; the tokens before `leaf.key` were cached already."""

    def on_evict(self, leaf: TreeNode) -> None:
        """`leaf` is about to be removed; it is still linked to its parent."""

    def on_reset(self) -> None:
        """The whole tree was emptied."""

    def on_tier(self, node: TreeNode, tier: str) -> None:
        """Hierarchical cache: `node`'s KV now lives in `tier` (device | host); its path stays cached."""


def common_prefix_len(edge: list[int], key: list[int], start: int = 0) -> int:
    """How many leading tokens `edge` shares with `key[start:]`.

    A whole-edge match (the usual case when walking a tree) costs one C-level list
    comparison; only a mismatch is located token by token.
    """
    n = min(len(edge), len(key) - start)
    if key[start:start + n] == (edge if n == len(edge) else edge[:n]):
        return n
    for i in range(n):
        if edge[i] != key[start + i]:
            return i
    return n


class RadixCache:
    """Prefix cache over token ids whose slots come from `allocator`.

    Ownership: every slot is either free in the allocator, owned by the tree, or
    owned by a live request. The tree frees slots only in `evict` and `reset`.

    A request's lifetime, as the scheduler drives it:

    1. `m = match_prefix(ids)`; `inc_lock_ref(m.last_node)`. The request reuses
       `m.indices` (tree-owned; never free them) and allocates slots for the rest.
    2. When done (or to publish a finished chunk): `n = insert(ids, slots)` where
       `slots` are the KV slots of all of `ids` (`slots[:len(m.indices)]` being
       `m.indices`). The tree now owns `slots[n:]`; the request frees
       `slots[len(m.indices):n]`, which duplicate slots the tree already had.
       Then `dec_lock_ref(m.last_node)`. To keep running after a chunk, match
       `ids` again and lock the new `last_node` before unlocking the old one.
    3. On abort without inserting: free the request's own slots
       (`slots[len(m.indices):]`) and `dec_lock_ref(m.last_node)`.

    With `disable=True` the tree stays empty and the same caller code is correct:
    `match_prefix` returns an empty prefix and the root, `insert` stores nothing
    and returns `len(key)`, so the request frees `slots[0:len(key)]`, i.e. all of
    its slots; locking the root, `evict` and `reset` are no-ops.
    """

    def __init__(self, allocator: KVSlotAllocator, disable: bool = False,
                 listener: CacheListener | None = None) -> None:
        self.allocator = allocator
        self.device = allocator.device
        self.disable = disable
        self.listener = listener
        """Optional observer of inserted and evicted paths; None costs nothing."""
        self.root = TreeNode(value=self._empty(), lock_ref=1)
        self._evictable_size = 0
        self._protected_size = 0

    def reset(self) -> None:
        """Free every slot of the tree to the allocator and empty it; nothing may be locked."""
        assert self._protected_size == 0, f"reset with {self._protected_size} locked tokens"
        for node in self._all_nodes():
            if node is not self.root:
                self.allocator.free(node.value)
        self.root = TreeNode(value=self._empty(), lock_ref=1)
        self._evictable_size = 0
        self._protected_size = 0
        if self.listener is not None:
            self.listener.on_reset()

    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of `key`; splits an edge so `last_node` ends exactly at the match.

        Marks the matched path as recently used. Does not lock it.
        """
        if self.disable:
            return MatchResult(self._empty(), self.root)
        now = _now()
        node = self.root
        node.last_access_time = now
        pieces: list[torch.Tensor] = []
        i = 0
        while i < len(key) and key[i] in node.children:
            child = node.children[key[i]]
            matched = common_prefix_len(child.key, key, i)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access_time = now
            pieces.append(child.value)
            node = child
            i += matched
        indices = torch.cat(pieces) if pieces else self._empty()
        return MatchResult(indices, node)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Cache `key` -> `value` (int64 slots [len(key)]); return how many leading tokens it already had.

        With `n` the return value, the tree takes ownership of `value[n:]` (it
        copies them, so `value` may be a view of a row that is reused later) and
        keeps its own slots for `key[:n]`. The caller still owns `value[:n]` and
        must free the part it allocated itself, `value[len(prefix):n]`, where
        `prefix` is the tree-owned prefix it matched and locked before. When
        disabled, stores nothing and returns `len(key)`: the caller frees all of
        its own slots.
        """
        assert value.dim() == 1 and value.numel() == len(key), (
            f"value shape {tuple(value.shape)} does not match key length {len(key)}"
        )
        if self.disable:
            return len(key)
        now = _now()
        node = self.root
        node.last_access_time = now
        i = 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                self._add_leaf(node, key[i:], value[i:], now)
                break
            matched = common_prefix_len(child.key, key, i)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access_time = now
            node = child
            i += matched
        return i

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the path root..node against eviction; return tokens moved from evictable to protected."""
        moved = 0
        while node is not self.root:
            if node.lock_ref == 0 and node.on_device:  # host-tier nodes hold no device slots
                moved += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None, "locking a node that is not in the tree"
            node = node.parent
        self._evictable_size -= moved
        self._protected_size += moved
        return moved

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one `inc_lock_ref(node)`; return tokens moved from protected to evictable."""
        moved = 0
        while node is not self.root:
            assert node.lock_ref > 0, f"unlocking an unlocked node (key starts {node.key[:4]})"
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.on_device:
                moved += len(node.key)
            assert node.parent is not None, "unlocking a node that is not in the tree"
            node = node.parent
        self._protected_size -= moved
        self._evictable_size += moved
        return moved

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until `num_tokens` are freed.

        Whole leaves are evicted, so the result may exceed `num_tokens`; it is less
        only when nothing evictable is left. Returns the number of tokens freed.
        """
        return self._evict_where(num_tokens, None)

    def _evict_where(self, num_tokens: int, where: Callable[[TreeNode], bool] | None) -> int:
        """`evict` among the subtrees whose leaves `where` accepts (None: all); a parent left a leaf by an eviction
        is in its child's subtree."""
        if self.disable or num_tokens <= 0:
            return 0
        tie = itertools.count()
        heap = [
            (node.last_access_time, next(tie), node)
            for node in self._all_nodes()
            if node.is_leaf and node.lock_ref == 0 and node is not self.root and (where is None or where(node))
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            if self.listener is not None:
                self.listener.on_evict(leaf)
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            parent = self._remove_leaf(leaf)
            if parent is not self.root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, next(tie), parent))
        return freed

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Tokens in locked nodes (excluding the root, which holds none)."""
        return self._protected_size

    def total_size(self) -> int:
        """Tokens in the tree, counted by walking it."""
        return sum(len(node.key) for node in self._all_nodes())

    def pretty_print(self) -> str:
        """One line per node, indented by depth: key, slots, lock_ref. Returned, not printed."""
        lines: list[str] = []
        stack: list[tuple[TreeNode, int]] = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            lines.append(f"{'  ' * depth}{node.key} -> {node.value.tolist()} lock={node.lock_ref}")
            stack.extend((child, depth + 1) for child in reversed(node.children.values()))
        return "\n".join(lines)

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _all_nodes(self) -> list[TreeNode]:
        nodes, stack = [], [self.root]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor, now: float) -> None:
        value = value.to(device=self.device, dtype=torch.int64).clone()
        leaf = TreeNode(key=list(key), value=value, parent=parent, last_access_time=now)
        parent.children[key[0]] = leaf
        self._evictable_size += len(key)
        if self.listener is not None:
            self.listener.on_insert(leaf)

    def _split(self, node: TreeNode, split_len: int) -> TreeNode:
        """Cut `node`'s edge after `split_len` tokens; return the new upper node.

        `node` keeps the lower part, so references to it (a request's `last_node`)
        still end at the same place. Locks through `node` also pass through the
        new node, so it inherits `lock_ref`; sizes do not change.
        """
        assert 0 < split_len < len(node.key), f"bad split {split_len} of an edge of {len(node.key)}"
        parent = node.parent
        assert parent is not None, "splitting the root"
        upper = TreeNode(
            key=node.key[:split_len],
            value=node.value[:split_len],
            parent=parent,
            children={node.key[split_len]: node},
            lock_ref=node.lock_ref,
            last_access_time=node.last_access_time,
            on_device=node.on_device,
            host_value=None if node.host_value is None else node.host_value[:split_len],
        )
        parent.children[upper.key[0]] = upper
        node.key = node.key[split_len:]
        node.value = node.value[split_len:]
        if node.host_value is not None:
            node.host_value = node.host_value[split_len:]
        node.parent = upper
        return upper

    def _remove_leaf(self, leaf: TreeNode) -> TreeNode:
        parent = leaf.parent
        assert parent is not None and leaf.is_leaf and leaf.lock_ref == 0, "removing a non-evictable node"
        del parent.children[leaf.key[0]]
        self._evictable_size -= len(leaf.key)
        return parent
