"""Block events of the radix cache: which full token blocks it stores and evicts.

The scheduler process records them with `BlockEventRecorder` (a `CacheListener` on its
RadixCache) and sends them to the front end in a `KVEventsMsg` after each step; a worker
publishes them to the KV-cache index. Without a recorder the cache pays nothing.

A block is "stored" when the tree caches a path covering it entirely; its key is the
chained block hash of the path up to its end (`radixmesh.wire.block_hash`), so the
events name exactly the keys routers look up. Sibling paths diverge at a node boundary,
so every block that ends past that boundary belongs to exactly one leaf's path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixmesh.wire.block_hash import block_hashes
from radixmesh.wire.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent, KVEventsMsg
from radixmesh.wire.lora import namespace_extra_key, split_namespace

if TYPE_CHECKING:
    from radixmesh.engine.radix_cache import TreeNode


def token_path(node: TreeNode) -> list[int]:
    """Token ids from the root down to and including `node`'s key."""
    pieces: list[list[int]] = []
    current: TreeNode | None = node
    while current is not None and current.parent is not None:
        pieces.append(current.key)
        current = current.parent
    return [tok for piece in reversed(pieces) for tok in piece]


class BlockEventRecorder:
    """A `CacheListener` that turns leaf inserts and evictions into block events."""

    def __init__(self, block_size: int, extra_key: bytes = b"") -> None:
        assert block_size >= 1, f"block_size must be >= 1, got {block_size}"
        self.block_size = block_size
        self.extra_key = extra_key
        self.events: list[KVEvent] = []

    def on_insert(self, leaf: TreeNode) -> None:
        hashes = self._leaf_blocks(leaf)
        if hashes:
            self.events.append(BlocksStored(hashes))

    def on_evict(self, leaf: TreeNode) -> None:
        hashes = self._leaf_blocks(leaf)
        if hashes:
            self.events.append(BlocksRemoved(hashes))

    def on_reset(self) -> None:
        self.events = [AllBlocksCleared()]

    def on_tier(self, node: TreeNode, tier: str) -> None:
        hashes = self._leaf_blocks(node)
        if hashes:
            self.events.append(BlocksStored(hashes, tier))

    def drain(self) -> KVEventsMsg | None:
        """The events recorded since the last drain, or None when there are none."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return KVEventsMsg(events, self.block_size)

    def _leaf_blocks(self, leaf: TreeNode) -> list[int]:
        """Keys of the blocks that end inside `leaf`'s own key (after its parent's path); `leaf` may be any node."""
        path = token_path(leaf)
        start = len(path) - len(leaf.key)
        first, end = start // self.block_size, len(path) // self.block_size
        if first >= end:
            return []
        namespace, tokens = split_namespace(path[: end * self.block_size])  # an adapter's prefix: its own key
        extra = self.extra_key + namespace_extra_key(namespace)
        return block_hashes(tokens, self.block_size, extra)[first:]
