"""RadixCache under random operations, driven as a scheduler would: every slot is owned exactly once (by the free
list, the tree, or one live request) after every step."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.engine.radix_cache import TreeNode

from .radix_factory import all_nodes, make_cache, path_to


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
