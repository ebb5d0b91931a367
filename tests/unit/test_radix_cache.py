"""RadixCache: hand-made match/insert/split/evict cases and a randomized ownership check."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


@dataclass
class SimReq:
    """A live request: tree-owned `prefix` locked through `node`, plus slots it allocated."""

    ids: list[int]
    prefix: torch.Tensor
    node: TreeNode
    own: torch.Tensor


class Simulator:
    """Drives RadixCache as a scheduler would and checks slot ownership after each step."""

    def __init__(self, size: int = 48) -> None:
        self.size = size
        self.allocator, self.cache = make_cache(size)
        self.live: list[SimReq] = []

    def alloc(self, n: int) -> torch.Tensor | None:
        if self.allocator.available_size() < n:
            self.cache.evict(n - self.allocator.available_size())
        return self.allocator.alloc(n)

    def new(self, ids: list[int]) -> None:
        m = self.cache.match_prefix(ids)
        self.cache.inc_lock_ref(m.last_node)
        own = self.alloc(len(ids) - m.indices.numel())
        if own is None:
            self.cache.dec_lock_ref(m.last_node)
            return
        self.live.append(SimReq(list(ids), m.indices, m.last_node, own))

    def extend(self, i: int, tokens: list[int]) -> None:
        req = self.live[i % len(self.live)]
        more = self.alloc(len(tokens))
        if more is not None:
            req.ids += tokens
            req.own = torch.cat([req.own, more])

    def _insert(self, req: SimReq) -> None:
        slots = torch.cat([req.prefix, req.own])
        n = self.cache.insert(req.ids, slots)
        self.allocator.free(slots[req.prefix.numel() : n])

    def finish(self, i: int) -> None:
        req = self.live.pop(i % len(self.live))
        self._insert(req)
        self.cache.dec_lock_ref(req.node)

    def publish_chunk(self, i: int) -> None:
        req = self.live[i % len(self.live)]
        self._insert(req)
        m = self.cache.match_prefix(req.ids)
        assert m.indices.numel() == len(req.ids)
        self.cache.inc_lock_ref(m.last_node)
        self.cache.dec_lock_ref(req.node)
        req.prefix, req.node, req.own = m.indices, m.last_node, m.indices[:0]

    def abort(self, i: int) -> None:
        req = self.live.pop(i % len(self.live))
        self.allocator.free(req.own)
        self.cache.dec_lock_ref(req.node)

    def apply(self, op: str, n: int, tokens: list[int]) -> None:
        if op == "new" and tokens:
            self.new(tokens)
        elif op == "match":
            self.cache.match_prefix(tokens)
        elif op == "evict":
            self.cache.evict(n)
        elif op == "reset" and not self.live:
            self.cache.reset()
        elif op == "extend" and self.live:
            self.extend(n, tokens)
        elif op == "finish" and self.live:
            self.finish(n)
        elif op == "publish" and self.live:
            self.publish_chunk(n)
        elif op == "abort" and self.live:
            self.abort(n)
        self.check()

    def check(self) -> None:
        nodes = all_nodes(self.cache)
        tree_slots = [s for node in nodes for s in node.value.tolist()]
        live_slots = [s for req in self.live for s in req.own.tolist()]
        free_slots = self.allocator._free_slots.tolist()
        assert sorted(tree_slots + live_slots + free_slots) == list(range(1, self.size + 1))
        self._check_structure(nodes)
        self._check_locks(nodes)
        for req in self.live:
            keys, slots = path_to(req.node)
            assert keys == req.ids[: len(keys)] and slots == req.prefix.tolist()

    def _check_structure(self, nodes: list[TreeNode]) -> None:
        assert self.cache.root.lock_ref == 1 and self.cache.root.key == []
        for node in nodes:
            for first, child in node.children.items():
                assert child.parent is node and child.key[0] == first
                assert len(child.key) == child.value.numel() > 0

    def _check_locks(self, nodes: list[TreeNode]) -> None:
        expected: dict[int, int] = {}
        for req in self.live:
            node: TreeNode | None = req.node
            while node is not None and node is not self.cache.root:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        protected = 0
        for node in nodes[1:]:
            assert node.lock_ref == expected.get(id(node), 0)
            protected += len(node.key) if node.lock_ref else 0
        assert self.cache.protected_size() == protected
        assert self.cache.evictable_size() + self.cache.protected_size() == self.cache.total_size()


OPS = ["new", "new", "extend", "finish", "publish", "abort", "evict", "match", "reset"]
op_strategy = st.tuples(
    st.sampled_from(OPS), st.integers(0, 20), st.lists(st.integers(0, 3), min_size=0, max_size=10)
)


@settings(max_examples=150, deadline=None)
@given(st.lists(op_strategy, max_size=40))
def test_random_ops_keep_every_slot_owned_once(ops: list[tuple[str, int, list[int]]]) -> None:
    sim = Simulator()
    for op, n, tokens in ops:
        sim.apply(op, n, tokens)


@pytest.mark.parametrize("seed", range(6))
def test_long_random_run_keeps_every_slot_owned_once(seed: int) -> None:
    rng = random.Random(seed)
    prompts = [[rng.randrange(6) for _ in range(rng.randrange(4, 14))] for _ in range(5)]
    sim = Simulator(size=96)
    for _ in range(600):
        base = rng.choice(prompts)
        tokens = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(6) for _ in range(rng.randrange(4))]
        sim.apply(rng.choice(OPS), rng.randrange(30), tokens)
    while sim.live:
        sim.apply(rng.choice(["finish", "abort"]), 0, [])
    assert sim.cache.protected_size() == 0
    sim.cache.evict(sim.size)
    assert sim.allocator.available_size() == sim.size
