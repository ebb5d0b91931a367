"""The host tier's controller on its own (engine/hicache/controller.py) over a real HiRadixCache on CPU pools:
which waiting requests get a load, the KV budget it respects, holds until admission (and their timeout), requests
joining a load in flight, and what admission may take meanwhile."""

from __future__ import annotations

import pytest

from radixmesh.engine.hicache import controller as controller_module
from radixmesh.engine.hicache.controller import MIN_LOAD_TOKENS, HiCacheController
from radixmesh.engine.hicache.tree import HiRadixCache
from radixmesh.engine.kv_manager import KVCacheManager
from radixmesh.engine.memory import ReqToTokenPool
from radixmesh.engine.request import Req
from radixmesh.wire.sampling import SamplingParams

from .test_hicache_tree import insert, make_tree


def setup(device_slots: int = 64, host_slots: int = 128, window: int = 4) -> tuple[HiCacheController, HiRadixCache]:
    tree, pool = make_tree(device_slots, host_slots)
    kv = KVCacheManager(ReqToTokenPool(8, 256, "cpu"), pool, tree.allocator, tree)
    return HiCacheController(kv, tree, window), tree


def on_host(tree: HiRadixCache, key: list[int]) -> None:
    """`key`'s KV in the host tier only (written out, then evicted from the device)."""
    insert(tree, key)
    tree.evict(tree.total_size())
    assert tree.match_host(key).host_len == len(key) and tree.total_size() == 0


def req(rid: str, ids: list[int], max_new_tokens: int = 4) -> Req:
    return Req(rid=rid, origin_input_ids=ids, params=SamplingParams(max_new_tokens=max_new_tokens))


def settle(controller: HiCacheController) -> None:
    """Let loads in flight finish (CPU copies are synchronous; `wait` still returns at once)."""
    controller.wait(1.0)
    controller.tree.complete_loads()


def test_a_host_hit_is_loaded_and_the_request_waits_for_it() -> None:
    controller, tree = setup()
    prefix = list(range(100, 140))
    on_host(tree, prefix)
    r = req("r", [*prefix, 1, 2])
    controller.tick([r], [], 0.5)
    assert set(controller.holds) == {"r"} and controller.num_host_hit_tokens == 40 and controller.busy
    assert controller.loading and controller.ready([r]) == []  # left out of admission until its prefix is here
    settle(controller)
    controller.tick([r], [], 0.5)
    assert controller.ready([r]) == [r] and len(tree.match_prefix(r.origin_input_ids).indices) == 40
    assert r.host_load is not None and r.host_load[2] == 40  # when and how much, for the worker's span
    controller.tick([], [], 0.5)  # admitted: it left the queue, the hold goes
    assert controller.holds == {} and tree.protected_size() == 0


def test_short_host_hits_are_recomputed_not_loaded() -> None:
    controller, tree = setup()
    short = list(range(MIN_LOAD_TOKENS - 1))
    on_host(tree, short)
    controller.tick([req("r", [*short, 5])], [], 0.5)
    assert controller.holds == {} and controller.num_host_hit_tokens == 0


def test_a_load_must_fit_beside_the_running_requests_reserve() -> None:
    controller, tree = setup(device_slots=64)
    prefix = list(range(200, 240))
    on_host(tree, prefix)
    running = [req("run", [1, 2, 3], max_new_tokens=60)]
    controller.tick([req("r", [*prefix, 9], max_new_tokens=4)], running, 1.0)
    assert controller.holds == {}  # 40 + the rest + 60 reserved do not fit 64
    controller.tick([req("r", [*prefix, 9], max_new_tokens=4)], running, 0.2)
    assert set(controller.holds) == {"r"}


def test_only_the_oldest_window_of_the_queue_is_looked_at() -> None:
    controller, tree = setup(window=1)
    first, second = list(range(300, 330)), list(range(400, 430))
    on_host(tree, first)
    on_host(tree, second)
    controller.tick([req("a", [*first, 1]), req("b", [*second, 1])], [], 0.5)
    assert set(controller.holds) == {"a"}


def test_a_request_on_a_path_already_loading_joins_that_load() -> None:
    controller, tree = setup()
    prefix = list(range(500, 540))
    on_host(tree, prefix)
    a, b = req("a", [*prefix, 1]), req("b", [*prefix, 2])
    controller.tick([a, b], [], 0.5)  # a's load starts; b finds it in flight and waits for it too
    assert set(controller.holds) == {"a", "b"} and controller.ready([a, b]) == []
    assert controller.num_host_hit_tokens == 80 and len(tree.loads) == 1


def test_a_hold_whose_request_is_never_admitted_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller_module, "MAX_HOLD_TICKS", 3)
    controller, tree = setup()
    prefix = list(range(600, 640))
    on_host(tree, prefix)
    r = req("r", [*prefix, 1])
    controller.tick([r], [], 0.5)
    settle(controller)
    for _ in range(5):
        controller.tick([r], [], 0.5)
    assert controller.holds == {} and controller.num_hold_timeouts == 1
    assert tree.protected_size() == 0  # the loaded KV stays cached, unlocked


def test_stats_name_the_tiers_state() -> None:
    controller, tree = setup(host_slots=96)
    on_host(tree, list(range(700, 730)))
    stats = controller.stats()
    assert stats["hicache_host_capacity_tokens"] == 96 and stats["hicache_host_tokens"] == 30
    assert stats["hicache_host_free_tokens"] == 66 and stats["hicache_num_holds"] == 0
    assert stats["hicache_loads_in_flight"] == 0 and stats["hicache_num_hold_timeouts"] == 0


def test_with_nothing_loading_every_waiting_request_is_admissible() -> None:
    controller, _ = setup()
    waiting = [req("a", [1, 2]), req("b", [3, 4])]
    assert controller.ready(waiting) is waiting and not controller.busy and not controller.loading
