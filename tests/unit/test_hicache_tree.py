"""HiRadixCache on CPU pools: nodes move device -> host -> device with their KV intact, sizes stay exact,
the host tier evicts LRU last, and block events name the tier."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.hicache.host_pool import HostKVPool, HostSlotAllocator, slot_runs
from radixmesh.engine.hicache.transfer import HostTransfer
from radixmesh.engine.hicache.tree import HiRadixCache
from radixmesh.engine.kv_events import BlockEventRecorder
from radixmesh.engine.memory import KVSlotAllocator, TokenToKVPool
from radixmesh.wire.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored

LAYERS, HEADS, DIM = 2, 2, 4


def make_tree(device_slots: int = 64, host_slots: int = 128, write_through: bool = False,
              ) -> tuple[HiRadixCache, TokenToKVPool]:
    pool = TokenToKVPool(device_slots, LAYERS, HEADS, DIM, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf.copy_(torch.randn(buf.shape, generator=gen))
    allocator = KVSlotAllocator(device_slots, "cpu", check_double_free=True)
    host = HostKVPool(host_slots, LAYERS, HEADS, DIM, torch.float32, pin_memory=False)
    return HiRadixCache(allocator, host, HostTransfer(pool, host), write_through), pool


def kv_at(pool: TokenToKVPool, slots: torch.Tensor) -> torch.Tensor:
    """[tokens, layers, 2, heads, dim] of the device pool."""
    return torch.stack([torch.stack([pool.k_buffers[layer][slots], pool.v_buffers[layer][slots]], dim=1)
                        for layer in range(LAYERS)], dim=1)


def insert(tree: HiRadixCache, key: list[int]) -> torch.Tensor:
    """Insert `key` with fresh slots (as a finished request would) and return the slots the tree holds for it."""
    match = tree.match_prefix(key)
    slots = tree.allocator.alloc(len(key) - len(match.indices))
    assert slots is not None
    value = torch.cat([match.indices, slots])
    shared = tree.insert(key, value)
    tree.allocator.free(value[len(match.indices):shared])
    return tree.match_prefix(key).indices


def load(tree: HiRadixCache, key: list[int]) -> int:
    """Load the host part of `key`'s match as the controller does; returns the tokens loaded."""
    match = tree.match_host(key)
    if not match.host_nodes:
        return 0
    node = match.host_nodes[-1]
    tree.inc_lock_ref(node)
    slots = tree.allocator.alloc(match.host_len)
    if slots is None:
        tree.evict(match.host_len - tree.allocator.available_size())
        slots = tree.allocator.alloc(match.host_len)
    assert slots is not None
    tree.start_load(match.host_nodes, slots)
    tree.complete_loads()
    tree.dec_lock_ref(node)
    return match.host_len


def check_sizes(tree: HiRadixCache) -> None:
    assert tree.allocator.available_size() + tree.total_size() == tree.allocator.size
    assert tree.evictable_size() + tree.protected_size() == tree.total_size()
    assert tree.host_allocator.available_size() + tree.host_size() == tree.host_allocator.size


@pytest.mark.parametrize("write_through", [False, True])
def test_evicted_node_moves_to_host_and_loads_back_bit_for_bit(write_through: bool) -> None:
    tree, pool = make_tree(write_through=write_through)
    key = list(range(100, 130))
    before = kv_at(pool, insert(tree, key)).clone()
    if write_through:
        assert tree.flush_backups() == 30 and tree.host_size() == 30
    assert tree.evict(30) == 30
    assert tree.total_size() == 0 and tree.host_size() == 30 and len(tree.match_prefix(key).indices) == 0
    match = tree.match_host([*key, 7])
    assert match.host_len == 30 and len(match.device.indices) == 0
    assert load(tree, key) == 30
    after = tree.match_prefix(key).indices
    assert len(after) == 30 and torch.equal(kv_at(pool, after), before)
    check_sizes(tree)


def test_partial_hit_splits_a_host_node_and_loads_only_the_matched_part() -> None:
    tree, pool = make_tree()
    key = list(range(40))
    before = kv_at(pool, insert(tree, key)).clone()
    tree.evict(40)
    assert load(tree, [*key[:25], 999]) == 25
    assert len(tree.match_prefix(key).indices) == 25  # the rest stays on the host
    assert tree.match_host(key).host_len == 15
    assert torch.equal(kv_at(pool, tree.match_prefix(key[:25]).indices), before[:25])
    check_sizes(tree)


def test_insert_over_host_nodes_takes_the_new_slots_and_counts_only_device_tokens_as_shared() -> None:
    tree, _ = make_tree()
    tree_key = list(range(20))
    insert(tree, tree_key)
    tree.evict(20)
    key = [*tree_key, 50, 51, 52]
    slots = tree.allocator.alloc(len(key))
    assert slots is not None
    assert tree.insert(key, slots) == 0  # nothing was on the device: the tree owns every slot now
    assert torch.equal(tree.match_prefix(key).indices, slots)
    assert tree.host_size() == 20  # the host copy stays (a later eviction only frees device slots)
    check_sizes(tree)


def test_device_eviction_takes_leaves_first_and_keeps_the_off_device_subtree_below_device_nodes() -> None:
    tree, _ = make_tree()
    insert(tree, list(range(10)))
    insert(tree, [*range(10), 20, 21, 22, 23])
    tree.evict(1)  # the LRU device leaf: the 4-token branch
    root_child = tree.root.children[0]
    assert root_child.on_device and all(not c.on_device for c in root_child.children.values())
    tree.evict(100)
    assert tree.total_size() == 0 and tree.host_size() == 14
    check_sizes(tree)


def test_host_tier_full_evicts_host_lru_and_drops_what_cannot_be_kept() -> None:
    tree, _ = make_tree(device_slots=64, host_slots=30)
    for start in (0, 1000, 2000):
        insert(tree, list(range(start, start + 20)))
    tree.evict(60)  # all leave the device; the host (30 slots) keeps the most recent node only
    assert tree.total_size() == 0
    assert tree.host_size() <= 30
    assert tree.counters["hicache_host_evicted_tokens"] + tree.counters["hicache_dropped_tokens"] == 40
    assert tree.match_host(list(range(2000, 2020))).host_len == 20  # the most recent stays
    check_sizes(tree)


def test_locked_nodes_stay_on_the_device_and_loading_nodes_are_not_split() -> None:
    tree, _ = make_tree()
    key = list(range(30))
    insert(tree, key)
    node = tree.match_prefix(key).last_node
    tree.inc_lock_ref(node)
    assert tree.evict(30) == 0
    tree.dec_lock_ref(node)
    tree.evict(30)
    match = tree.match_host(key)
    tree.inc_lock_ref(match.host_nodes[-1])
    slots = tree.allocator.alloc(30)
    assert slots is not None
    tree.start_load(match.host_nodes, slots)
    op = tree.loads[0].op
    op.done = lambda: False  # type: ignore[method-assign]  # as if the DMA were still in flight
    assert tree.complete_loads() == 0
    partial = tree.match_host(key[:10])
    assert partial.loading_node is match.host_nodes[-1] and len(partial.loading_node.key) == 30
    del op.done
    assert tree.complete_loads() == 1
    tree.dec_lock_ref(match.host_nodes[-1])
    assert len(tree.match_prefix(key).indices) == 30
    check_sizes(tree)


def test_reset_frees_both_tiers() -> None:
    tree, _ = make_tree(write_through=True)
    insert(tree, list(range(12)))
    tree.flush_backups()
    insert(tree, list(range(50, 60)))
    tree.evict(100)
    tree.reset()
    assert tree.total_size() == tree.host_size() == 0
    assert tree.allocator.available_size() == 64 and tree.host_allocator.available_size() == 128


def test_block_events_name_the_tier() -> None:
    tree, _ = make_tree()
    recorder = BlockEventRecorder(block_size=4)
    tree.listener = recorder
    key = list(range(12))
    insert(tree, key)
    tree.evict(12)
    load(tree, key)
    events = recorder.drain()
    assert events is not None
    tiers = [(type(e).__name__, getattr(e, "tier", None), len(getattr(e, "block_hashes", []))) for e in events.events]
    assert tiers == [("BlocksStored", "device", 3), ("BlocksStored", "host", 3), ("BlocksStored", "device", 3)]
    tree.evict(12)
    tree.evict_host(12)
    events = recorder.drain()
    assert events is not None and isinstance(events.events[-1], BlocksRemoved)
    tree.reset()
    events = recorder.drain()
    assert events is not None and isinstance(events.events[0], AllBlocksCleared)
    assert not any(isinstance(e, BlocksStored) for e in events.events)


def test_host_slot_allocator_best_fit_merges_and_asserts_double_free() -> None:
    alloc = HostSlotAllocator(22)
    a, b, c = alloc.alloc(5), alloc.alloc(5), alloc.alloc(5)
    assert a is not None and b is not None and c is not None
    assert a.tolist() == [1, 2, 3, 4, 5] and alloc.num_runs() == 1
    alloc.free(b)
    assert alloc.num_runs() == 2
    d = alloc.alloc(4)  # best fit: the 5-slot hole, not the 7-slot tail
    assert d is not None and d.tolist() == [6, 7, 8, 9]
    alloc.free(torch.cat([a, c]))
    assert alloc.num_runs() == 2 and alloc.available_size() == 18  # [1, 5] + [10, 22]
    e = alloc.alloc(15)  # no run is long enough: the largest first, then the rest
    assert e is not None and e.tolist() == [*range(10, 23), 1, 2]
    alloc.free(torch.cat([d, e]))
    assert alloc.num_runs() == 1 and alloc.available_size() == 22
    with pytest.raises(AssertionError, match="freed twice"):
        alloc.free(torch.tensor([7]))
    assert alloc.alloc(23) is None
    assert slot_runs(torch.tensor([4, 5, 6, 9, 2, 3])) == [(4, 3), (9, 1), (2, 2)]
