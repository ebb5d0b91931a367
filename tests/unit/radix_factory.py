"""Small factories for radix cache tests: a cache over a checked allocator, inserts, paths, nodes."""

from __future__ import annotations

import torch

from radixmesh.engine.memory import KVSlotAllocator
from radixmesh.engine.radix_cache import RadixCache, TreeNode


def make_cache(size: int = 64, disable: bool = False) -> tuple[KVSlotAllocator, RadixCache]:
    allocator = KVSlotAllocator(size, "cpu", check_double_free=True)
    return allocator, RadixCache(allocator, disable=disable)


def insert_new(allocator: KVSlotAllocator, cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Insert `key` with freshly allocated slots, freeing the duplicates as a scheduler would."""
    slots = allocator.alloc(len(key))
    assert slots is not None
    n = cache.insert(key, slots)
    allocator.free(slots[:n])
    return slots


def path_to(node: TreeNode) -> tuple[list[int], list[int]]:
    """Key and slots from the root down to `node`."""
    keys: list[int] = []
    slots: list[int] = []
    while node.parent is not None:
        keys = node.key + keys
        slots = node.value.tolist() + slots
        node = node.parent
    return keys, slots


def all_nodes(cache: RadixCache) -> list[TreeNode]:
    nodes, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    return nodes
