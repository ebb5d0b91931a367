"""RadixCache: hand-made match/insert/split/evict cases."""

from __future__ import annotations

import pytest
import torch

from .radix_factory import insert_new, make_cache, path_to


class TestMatchInsert:
    def test_empty_tree_matches_nothing(self) -> None:
        _, cache = make_cache()
        m = cache.match_prefix([1, 2, 3])
        assert m.indices.numel() == 0 and m.indices.dtype == torch.int64
        assert m.last_node is cache.root

    def test_exact_match_returns_inserted_slots(self) -> None:
        allocator, cache = make_cache()
        slots = insert_new(allocator, cache, [1, 2, 3])
        m = cache.match_prefix([1, 2, 3])
        assert m.indices.tolist() == slots.tolist()
        assert m.last_node.key == [1, 2, 3]
        assert cache.total_size() == 3 and cache.evictable_size() == 3

    def test_longer_query_matches_cached_prefix(self) -> None:
        allocator, cache = make_cache()
        slots = insert_new(allocator, cache, [1, 2, 3])
        m = cache.match_prefix([1, 2, 3, 4, 5])
        assert m.indices.tolist() == slots.tolist()
        assert m.last_node.key == [1, 2, 3]

    def test_match_inside_edge_splits(self) -> None:
        allocator, cache = make_cache()
        slots = insert_new(allocator, cache, [1, 2, 3, 4, 5])
        m = cache.match_prefix([1, 2, 3, 9])
        assert m.indices.tolist() == slots[:3].tolist()
        assert m.last_node.key == [1, 2, 3]
        assert list(m.last_node.children) == [4]
        child = m.last_node.children[4]
        assert child.key == [4, 5] and child.value.tolist() == slots[3:].tolist()
        assert child.parent is m.last_node and m.last_node.parent is cache.root
        assert cache.total_size() == 5 and cache.evictable_size() == 5

    def test_shorter_query_splits(self) -> None:
        allocator, cache = make_cache()
        slots = insert_new(allocator, cache, [1, 2, 3, 4])
        m = cache.match_prefix([1, 2])
        assert m.indices.tolist() == slots[:2].tolist()
        assert path_to(m.last_node) == ([1, 2], slots[:2].tolist())

    def test_insert_returns_already_cached_length(self) -> None:
        allocator, cache = make_cache()
        first = insert_new(allocator, cache, [1, 2, 3])
        second = allocator.alloc(5)
        assert second is not None
        assert cache.insert([1, 2, 3, 4, 5], second) == 3
        m = cache.match_prefix([1, 2, 3, 4, 5])
        assert m.indices.tolist() == first.tolist() + second[3:].tolist()

    def test_insert_diverging_key_splits(self) -> None:
        allocator, cache = make_cache()
        a = insert_new(allocator, cache, [1, 2, 3, 4])
        b = allocator.alloc(4)
        assert b is not None
        assert cache.insert([1, 2, 7, 8], b) == 2
        allocator.free(b[:2])
        shared = cache.root.children[1]
        assert shared.key == [1, 2] and shared.value.tolist() == a[:2].tolist()
        assert sorted(shared.children) == [3, 7]
        assert shared.children[7].value.tolist() == b[2:].tolist()
        assert cache.total_size() == 6

    def test_insert_prefix_of_existing_key(self) -> None:
        allocator, cache = make_cache()
        insert_new(allocator, cache, [1, 2, 3, 4])
        dup = allocator.alloc(2)
        assert dup is not None
        assert cache.insert([1, 2], dup) == 2
        assert cache.root.children[1].key == [1, 2]
        assert cache.total_size() == 4

    def test_insert_copies_value(self) -> None:
        allocator, cache = make_cache()
        row = torch.zeros(8, dtype=torch.int64)
        slots = allocator.alloc(3)
        assert slots is not None
        row[:3] = slots
        assert cache.insert([5, 6, 7], row[:3]) == 0
        row.fill_(0)
        assert cache.match_prefix([5, 6, 7]).indices.tolist() == slots.tolist()

    def test_insert_checks_lengths(self) -> None:
        _, cache = make_cache()
        with pytest.raises(AssertionError, match="does not match key length"):
            cache.insert([1, 2], torch.tensor([1]))

    def test_empty_key(self) -> None:
        _, cache = make_cache()
        assert cache.insert([], torch.empty(0, dtype=torch.int64)) == 0
        assert cache.match_prefix([]).last_node is cache.root

    def test_pretty_print_shows_keys(self) -> None:
        allocator, cache = make_cache()
        insert_new(allocator, cache, [1, 2, 3])
        insert_new(allocator, cache, [1, 2, 9])
        text = cache.pretty_print()
        assert "[1, 2]" in text and "[3]" in text and "[9]" in text


class TestEviction:
    def test_lru_order_over_leaves(self) -> None:
        allocator, cache = make_cache()
        insert_new(allocator, cache, [1, 1])
        insert_new(allocator, cache, [2, 2, 2])
        insert_new(allocator, cache, [3])
        cache.match_prefix([1, 1])
        free_before = allocator.available_size()
        assert cache.evict(1) == 3
        assert 2 not in cache.root.children
        assert cache.evict(1) == 1
        assert sorted(cache.root.children) == [1]
        assert cache.evict(10) == 2
        assert cache.total_size() == 0 and cache.evictable_size() == 0
        assert allocator.available_size() == free_before + 6 == 64

    def test_parent_becomes_leaf_after_children_go(self) -> None:
        allocator, cache = make_cache()
        insert_new(allocator, cache, [1, 2, 3])
        insert_new(allocator, cache, [1, 2, 3, 4, 5])
        insert_new(allocator, cache, [9])
        assert cache.evict(2) == 2
        assert cache.root.children[1].is_leaf
        assert cache.evict(1) == 3
        assert list(cache.root.children) == [9]

    def test_evicts_whole_leaf_and_stops(self) -> None:
        allocator, cache = make_cache()
        insert_new(allocator, cache, [1, 2, 3, 4])
        insert_new(allocator, cache, [5, 6])
        assert cache.evict(1) == 4
        assert cache.total_size() == 2

    def test_locked_path_is_never_evicted(self) -> None:
        allocator, cache = make_cache()
        insert_new(allocator, cache, [1, 2, 3, 4])
        insert_new(allocator, cache, [1, 2, 7])
        insert_new(allocator, cache, [8, 8])
        m = cache.match_prefix([1, 2, 3, 4])
        assert cache.inc_lock_ref(m.last_node) == 4
        assert cache.protected_size() == 4 and cache.evictable_size() == 3
        assert cache.evict(100) == 3
        assert path_to(m.last_node)[0] == [1, 2, 3, 4]
        assert cache.match_prefix([1, 2, 3, 4]).indices.tolist() == m.indices.tolist()
        assert cache.evict(100) == 0
        assert cache.dec_lock_ref(m.last_node) == 4
        assert cache.evictable_size() == 4 and cache.protected_size() == 0
        assert cache.evict(100) == 4
        assert allocator.available_size() == 64

    def test_unlocked_child_of_locked_node_is_evictable(self) -> None:
        allocator, cache = make_cache()
        insert_new(allocator, cache, [1, 2, 3, 4])
        m = cache.match_prefix([1, 2])
        cache.inc_lock_ref(m.last_node)
        assert cache.evict(100) == 2
        assert cache.total_size() == 2 and cache.protected_size() == 2

    def test_nested_locks_count(self) -> None:
        allocator, cache = make_cache()
        insert_new(allocator, cache, [1, 2, 3, 4])
        outer = cache.match_prefix([1, 2]).last_node
        inner = cache.match_prefix([1, 2, 3, 4]).last_node
        assert cache.inc_lock_ref(inner) == 4
        assert cache.inc_lock_ref(outer) == 0
        assert outer.lock_ref == 2 and inner.lock_ref == 1
        assert cache.dec_lock_ref(inner) == 2
        assert cache.protected_size() == 2 and cache.evictable_size() == 2
        assert cache.dec_lock_ref(outer) == 2
        with pytest.raises(AssertionError, match="unlocking an unlocked node"):
            cache.dec_lock_ref(outer)

    def test_split_of_locked_node_keeps_sizes(self) -> None:
        allocator, cache = make_cache()
        insert_new(allocator, cache, [1, 2, 3, 4])
        node = cache.match_prefix([1, 2, 3, 4]).last_node
        cache.inc_lock_ref(node)
        upper = cache.match_prefix([1, 2, 9]).last_node
        assert upper.lock_ref == 1 and node.parent is upper
        assert cache.protected_size() == 4 and cache.evictable_size() == 0
        cache.dec_lock_ref(node)
        assert upper.lock_ref == 0 and cache.evictable_size() == 4

    def test_reset_frees_everything(self) -> None:
        allocator, cache = make_cache()
        insert_new(allocator, cache, [1, 2, 3])
        insert_new(allocator, cache, [1, 5])
        node = cache.match_prefix([1, 5]).last_node
        cache.inc_lock_ref(node)
        with pytest.raises(AssertionError, match="locked"):
            cache.reset()
        cache.dec_lock_ref(node)
        cache.reset()
        assert allocator.available_size() == 64
        assert cache.total_size() == 0 and cache.root.is_leaf and cache.root.lock_ref == 1


class TestDisabled:
    def test_stores_nothing_and_caller_frees_all(self) -> None:
        allocator, cache = make_cache(disable=True)
        slots = allocator.alloc(3)
        assert slots is not None
        m = cache.match_prefix([1, 2, 3])
        assert m.indices.numel() == 0 and m.last_node is cache.root
        assert cache.inc_lock_ref(m.last_node) == 0
        n = cache.insert([1, 2, 3], slots)
        assert n == 3
        allocator.free(slots[m.indices.numel() : n])
        assert cache.dec_lock_ref(m.last_node) == 0
        assert allocator.available_size() == 64
        assert cache.total_size() == 0 and cache.evict(10) == 0
        assert cache.match_prefix([1, 2, 3]).indices.numel() == 0
