"""The dfs-weight order on its own: waiting requests matched against a real radix tree, walked heaviest first."""

from __future__ import annotations

import random

import pytest

from radixmesh.engine.kv_manager import KVCacheManager
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.dfs_weight import dfs_weight_order
from radixmesh.engine.scheduler.policy import order_waiting
from radixmesh.wire.sampling import SamplingParams

from .manager_factory import make_config, make_kv, req

A = list(range(1, 9))  # cached: 1..8
B = [1, 2, 3, 4, 20, 21, 22, 23]  # cached: shares 1..4 with A (the tree splits there)
C = [50, 51, 52, 53]  # cached: a prefix of its own


def cached(*keys: list[int]) -> KVCacheManager:
    """KV memory whose tree holds `keys` (slots from its own allocator)."""
    kv = make_kv(num_tokens=128)
    for key in keys:
        slots = kv.allocator.alloc(len(key))
        assert slots is not None
        held = kv.tree.insert(key, slots)
        if held:
            kv.allocator.free(slots[:held])  # the tree kept its own slots for the part it had
    return kv


def waiting(kv: KVCacheManager, prompts: dict[str, list[int]]) -> list[Req]:
    """Requests in `prompts`' order, each matched against the tree as admission matches it."""
    reqs = []
    for rid, ids in prompts.items():
        r = prompt(rid, ids)
        kv.match(r)
        reqs.append(r)
    return reqs


def prompt(rid: str, ids: list[int]) -> Req:
    """A request built with `ids` as its prompt (set later, its log-prob start would still be the old length)."""
    return Req(rid=rid, origin_input_ids=ids, params=SamplingParams(max_new_tokens=8, temperature=0.0))


PROMPTS = {
    "none": [88, 89],  # nothing cached: last
    "c": [*C, 9],  # the light subtree
    "p": [1, 2, 3, 4, 77],  # ends at the shared node: after the requests below it
    "b": [*B, 98],
    "a1": [*A, 99],
    "a2": [*A, 97],
}


def test_heaviest_subtree_first_deeper_before_shallower_and_uncached_last() -> None:
    kv = cached(A, B, C)
    reqs = waiting(kv, PROMPTS)
    assert [len(r.prefix_indices) for r in reqs] == [0, 4, 4, 8, 8, 8]
    # The shared node holds 4 requests (a1, a2, b, p) against c's 1; under it A's leaf (2) before B's (1).
    assert [r.rid for r in dfs_weight_order(reqs)] == ["a1", "a2", "b", "p", "c", "none"]


@pytest.mark.parametrize("seed", range(5))
def test_the_order_depends_on_the_tree_not_on_arrival_except_within_a_node(seed: int) -> None:
    kv = cached(A, B, C)
    names = list(PROMPTS)
    random.Random(seed).shuffle(names)
    reqs = waiting(kv, {n: PROMPTS[n] for n in names})
    order = [r.rid for r in dfs_weight_order(reqs)]
    a_first = names.index("a1") < names.index("a2")
    assert order == (["a1", "a2"] if a_first else ["a2", "a1"]) + ["b", "p", "c", "none"]


def test_ties_keep_the_order_their_first_request_arrived_in() -> None:
    kv = cached(A, C)
    reqs = waiting(kv, {"c": [*C, 5], "a": [*A, 5], "c2": [*C, 6], "a2": [*A, 6]})
    assert [r.rid for r in dfs_weight_order(reqs)] == ["c", "c2", "a", "a2"]
    reqs = waiting(kv, {"a": [*A, 5], "c": [*C, 5], "c2": [*C, 6], "a2": [*A, 6]})
    assert [r.rid for r in dfs_weight_order(reqs)] == ["a", "a2", "c", "c2"]


def test_every_request_comes_out_once_and_an_empty_queue_stays_empty() -> None:
    assert dfs_weight_order([]) == []
    kv = cached(A, B, C)
    rng = random.Random(3)
    prompts = {f"r{i}": [*rng.choice([A, B, C, [70 + i]])[:rng.randint(1, 8)], 200 + i] for i in range(40)}
    reqs = waiting(kv, prompts)
    order = dfs_weight_order(reqs)
    assert sorted(r.rid for r in order) == sorted(prompts)
    # Requests at one node stay together and in arrival order.
    for node in {id(r.matched_node) for r in reqs}:
        at = [r.rid for r in reqs if id(r.matched_node) == node]
        positions = [i for i, r in enumerate(order) if id(r.matched_node) == node]
        assert [order[i].rid for i in positions] == at
        assert positions == list(range(positions[0], positions[0] + len(at)))


def test_an_unmatched_request_is_a_programming_error() -> None:
    with pytest.raises(AssertionError, match="matched"):
        dfs_weight_order([req("x")])


def test_the_policy_matches_only_its_window_and_leaves_the_rest_in_arrival_order() -> None:
    kv = cached(A, B, C)
    queue = waiting(kv, PROMPTS)
    for r in queue:  # waiting requests are not matched until admission orders them
        r.matched_node, r.prefix_indices = None, r.prefix_indices[:0]
    late = prompt("late", [*A, 1])
    config = make_config(schedule_policy="dfs-weight", schedule_policy_window=6)
    order = order_waiting([*queue, late], config, kv)
    assert [r.rid for r in order.reqs] == ["a1", "a2", "b", "p", "c", "none", "late"]
    assert order.num_matched == 6 and late.matched_node is None and not order.deferred
