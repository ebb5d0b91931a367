"""The scheduler with a host tier (tiny random Llama, CPU): prompts evicted to host and hit again give
the same greedy tokens and report cached tokens; a request whose prefix is loading waits without
blocking others; nothing leaks in either pool."""

from __future__ import annotations

from typing import Any

import pytest

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.hicache.controller import HiCacheController
from radixmesh.engine.hicache.hook import HostTierHook
from radixmesh.engine.hicache.transfer import TransferOp
from radixmesh.engine.hicache.tree import HiRadixCache
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.core import Scheduler

from .scheduler_factory import assert_no_leak, clone, make_requests, make_scheduler, run_until_idle, single_run_outputs

POLICIES = ("write-through", "write-back")


def hi_scheduler(policy: str = "write-through", **overrides: Any) -> tuple[Scheduler, Any]:
    settings: dict[str, Any] = dict(max_total_tokens=200, enable_hierarchical_cache=True, hicache_ratio=6.0,
                                    hicache_write_policy=policy)
    settings.update(overrides)
    return make_scheduler(**settings)


def tree_of(sched: Scheduler) -> HiRadixCache:
    assert isinstance(sched.kv.tree, HiRadixCache)
    return sched.kv.tree


def controller_of(sched: Scheduler) -> HiCacheController:
    hook = sched.hooks.get(HostTierHook)
    assert hook is not None, "no host tier"
    return hook.controller


def assert_no_leak_either_tier(sched: Scheduler) -> None:
    assert_no_leak(sched)
    tree = tree_of(sched)
    assert not controller_of(sched).holds and not tree.loads and not tree.loading
    assert tree.host_allocator.available_size() + tree.host_size() == tree.host_pool.size, "host slots leaked"


def renamed(req: Req, suffix: str) -> Req:
    again = clone(req)
    again.rid = req.rid + suffix
    return again


@pytest.mark.parametrize("policy", POLICIES)
def test_prompt_evicted_to_host_and_hit_again_gives_identical_tokens(policy: str) -> None:
    reqs = make_requests(6, seed=3, prompt_len=(60, 80), max_new_tokens=8)
    expected = single_run_outputs(reqs)
    sched, out = hi_scheduler(policy)
    for req in reqs:  # one at a time: the pool (200 tokens) holds about two of them
        sched.add_request(clone(req))
        run_until_idle(sched)
    tree = tree_of(sched)
    assert tree.counters["hicache_offloaded_tokens"] > 0
    assert len(tree.match_prefix(reqs[0].origin_input_ids).indices) == 0
    for req in reqs[:3]:
        sched.add_request(renamed(req, "-again"))
        run_until_idle(sched)
    for req in reqs:
        assert out.tokens[req.rid] == expected[req.rid]
    for req in reqs[:3]:
        assert out.tokens[req.rid + "-again"] == expected[req.rid]
        assert out.cached[req.rid + "-again"] == len(req.origin_input_ids) - 1  # all but the last prompt token
    stats = sched.stats()
    assert stats["hicache_num_loads"] == 3 and stats["hicache_host_hit_tokens"] == sum(
        len(r.origin_input_ids) - 1 for r in reqs[:3])
    assert stats["num_cached_tokens"] == stats["hicache_host_hit_tokens"]
    assert_no_leak_either_tier(sched)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_concurrent_shared_prefixes_under_a_small_pool_match_single_runs(policy: str, overlap: str) -> None:
    reqs = make_requests(10, seed=11, shared_prefix_len=40, prompt_len=(10, 40), max_new_tokens=10)
    reqs += make_requests(6, seed=12, shared_prefix_len=30, prompt_len=(5, 30), max_new_tokens=6)
    expected = single_run_outputs(reqs)
    sched, out = hi_scheduler(policy, max_total_tokens=260, chunked_prefill_size=48, overlap_schedule=overlap,
                              max_running_requests=4)
    for wave in (reqs[:8], reqs[8:], [renamed(r, "-2") for r in reqs[::2]]):
        for req in wave:
            sched.add_request(clone(req) if not req.rid.endswith("-2") else req)
        run_until_idle(sched)
    for req in reqs:
        assert out.tokens[req.rid] == expected[req.rid], req.rid
        if req.rid + "-2" in out.tokens:
            assert out.tokens[req.rid + "-2"] == expected[req.rid]
    assert sched.stats()["hicache_host_hit_tokens"] > 0
    assert_no_leak_either_tier(sched)


class HeldEvent:
    """A fake CUDA event of a copy that finishes when the test says so (`synchronize` finishes it too)."""

    def __init__(self, gate: dict[str, bool]) -> None:
        self.gate = gate

    def query(self) -> bool:
        return self.gate["done"]

    def synchronize(self) -> None:
        self.gate["done"] = True


def hold_loads(sched: Scheduler) -> dict[str, bool]:
    """Make every later load stay in flight until `gate["done"]` is set; returns the gate."""
    gate = {"done": False}
    transfer = tree_of(sched).transfer
    real_load = transfer.load

    def held_load(host_slots: Any, device_slots: Any) -> TransferOp:
        op = real_load(host_slots, device_slots)
        op.event = HeldEvent(gate)  # type: ignore[assignment]
        return op

    transfer.load = held_load  # type: ignore[method-assign]
    return gate


def test_request_whose_prefix_is_loading_waits_without_blocking_others() -> None:
    first, other = make_requests(2, seed=5, prompt_len=(70, 70), max_new_tokens=4)
    expected = single_run_outputs([first, other])
    sched, out = hi_scheduler()
    sched.add_request(clone(first))
    run_until_idle(sched)
    tree_of(sched).evict(1000)  # everything to the host
    gate = hold_loads(sched)
    loads: dict[str, tuple[float, float, int]] = {}
    sched.emit = lambda outs: (loads.update({o.rid: o.host_load for o in outs if o.host_load}), out(outs))  # type: ignore
    sched.add_request(renamed(first, "-again"))
    sched.step()
    assert controller_of(sched).loading and sched.prefill.waiting[0].rid == first.rid + "-again"
    sched.add_request(clone(other))  # no host hit: admitted and finished while the other one's prefix loads
    for _ in range(20):
        sched.step()
    assert out.finish.get(other.rid) == "length" and first.rid + "-again" not in out.tokens
    assert [r.rid for r in sched.prefill.waiting] == [first.rid + "-again"]
    gate["done"] = True
    run_until_idle(sched)
    assert out.tokens[first.rid + "-again"] == expected[first.rid] and out.tokens[other.rid] == expected[other.rid]
    assert out.cached[first.rid + "-again"] == 69
    start, end, tokens = loads[first.rid + "-again"]  # for the worker's hicache_load span
    assert tokens == 69 and start <= end and other.rid not in loads
    assert_no_leak_either_tier(sched)


def test_two_requests_on_one_loading_path_share_the_load() -> None:
    base = make_requests(1, seed=8, prompt_len=(60, 60), max_new_tokens=3)[0]
    sched, out = hi_scheduler()
    sched.add_request(clone(base))
    run_until_idle(sched)
    tree_of(sched).evict(1000)
    gate = hold_loads(sched)
    a, b = renamed(base, "-a"), renamed(base, "-b")
    b.origin_input_ids = [*base.origin_input_ids[:40], 1, 2, 3]
    sched.add_request(a)
    sched.step()
    sched.add_request(b)
    sched.step()
    assert set(controller_of(sched).holds) == {a.rid, b.rid}
    gate["done"] = True
    run_until_idle(sched)
    assert tree_of(sched).counters["hicache_num_loads"] == 1
    assert out.cached[a.rid] == 59 and out.cached[b.rid] == 40
    assert_no_leak_either_tier(sched)


def test_abort_while_its_prefix_loads_leaks_nothing() -> None:
    base = make_requests(1, seed=9, prompt_len=(64, 64), max_new_tokens=3)[0]
    sched, out = hi_scheduler("write-back")
    sched.add_request(clone(base))
    run_until_idle(sched)
    tree_of(sched).evict(1000)
    gate = hold_loads(sched)
    sched.add_request(renamed(base, "-x"))
    sched.step()
    assert controller_of(sched).holds
    sched.abort(base.rid + "-x")
    sched.step()
    assert not controller_of(sched).holds and controller_of(sched).busy  # the hold is gone; the copy still runs
    gate["done"] = True
    run_until_idle(sched)
    assert out.finish[base.rid + "-x"] == "abort"
    assert_no_leak_either_tier(sched)
    assert sched.flush_cache()
    assert tree_of(sched).host_size() == 0 and sched.kv.allocator.available_size() == sched.kv.capacity


def test_hold_timeout_releases_a_loaded_prefix_that_cannot_be_admitted(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixmesh.engine.hicache import controller

    monkeypatch.setattr(controller, "MAX_HOLD_TICKS", 2)
    base = make_requests(1, seed=10, prompt_len=(50, 50), max_new_tokens=3)[0]
    sched, out = hi_scheduler()
    sched.add_request(clone(base))
    run_until_idle(sched)
    tree_of(sched).evict(1000)
    sched.add_request(renamed(base, "-y"))
    real = sched.prefill.schedule
    sched.prefill.schedule = lambda running, ratio: None  # type: ignore[method-assign]  # admission never happens
    for _ in range(5):
        sched.step()
    assert not controller_of(sched).holds and controller_of(sched).num_hold_timeouts == 1
    sched.prefill.schedule = real  # type: ignore[method-assign]
    run_until_idle(sched)
    assert out.finish[base.rid + "-y"] == "length"
    assert_no_leak_either_tier(sched)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"hicache_write_policy": "write-around"}, "hicache_write_policy must be one of write-through, write-back"),
    ({"hicache_size": -1.0}, "hicache_size must be >= 0"),
    ({"hicache_ratio": 0.0}, r"hicache_ratio must be in \(0, 1000\]"),
    ({"enable_hierarchical_cache": True, "disable_radix_cache": True}, "drop --disable-radix-cache"),
])
def test_bad_hicache_options_are_named(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(RadixMeshError, match=message):
        EngineConfig(**overrides)


def test_host_tier_larger_than_ram_is_refused_with_the_sizes() -> None:
    with pytest.raises(RadixMeshError, match=r"the host tier needs .* GB .* of RAM are available"):
        hi_scheduler(hicache_size=1e6)
