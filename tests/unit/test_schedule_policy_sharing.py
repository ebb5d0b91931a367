"""Burst prefix sharing (in-batch prefix caching), the dfs-weight policy and the policy window."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.config import SCHEDULE_POLICIES, EngineConfig
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.policy import PREFIX_ORDERS, order_waiting
from radixmesh.engine.scheduler.prefix_sharing import TokenTrie, defer_shared_prefixes
from radixmesh.wire.sampling import SamplingParams

from .scheduler_factory import (
    assert_no_leak,
    clone,
    make_requests,
    make_scheduler,
    run_until_idle,
    single_run_outputs,
    tiny_model_config,
)

PREFIX = 256
LONG_CONTEXT = tiny_model_config(max_position_embeddings=1024)


def _scheduler(**overrides):
    return make_scheduler(LONG_CONTEXT, **overrides)


@pytest.fixture(scope="module")
def burst() -> tuple[list[Req], dict[str, list[int]]]:
    reqs = make_requests(8, seed=11, shared_prefix_len=PREFIX, max_new_tokens=6, prompt_len=(4, 12))
    return reqs, single_run_outputs(reqs, LONG_CONTEXT)


@pytest.mark.parametrize("overrides", [
    {},
    {"schedule_policy": "dfs-weight"},
    {"overlap_schedule": "on"},
    {"chunked_prefill_size": 100},
    {"overlap_schedule": "on", "chunked_prefill_size": 64},
], ids=["lpm", "dfs-weight", "overlap", "chunked", "overlap-chunked"])
def test_burst_computes_the_shared_prefix_once(burst, overrides):
    reqs, expected = burst
    sched, col = _scheduler(**overrides)
    for req in reqs:
        sched.add_request(clone(req))
    first = sched.schedule()
    assert first is not None and len(first.reqs) == 1, "one request computes the shared prefix"
    sched.in_flight = sched.launch(first)
    while sched.prefill.chunked_req is not None:
        sched.step()
    # The others waited for the prefix, or joined the pass of a last chunk that did not compute any of it.
    waiting = list(sched.prefill.waiting)
    assert len(waiting) == (0 if overrides.get("chunked_prefill_size") == 64 else 7)
    for req in waiting:  # the prefix is in the cache before the first request's tokens are read back
        sched.kv.match(req)
        assert len(req.prefix_indices) >= PREFIX
    run_until_idle(sched)
    assert col.tokens == expected
    assert sum(col.cached.values()) >= 0.9 * 7 * PREFIX
    assert all(cached >= PREFIX for cached in sorted(col.cached.values())[1:])
    assert_no_leak(sched)


def test_deferred_requests_join_the_next_prefill(burst):
    reqs, _ = burst
    sched, _ = _scheduler()
    for req in reqs:
        sched.add_request(clone(req))
    sched.step()
    assert len(sched.running) == 1 and len(sched.prefill.waiting) == 7
    sched.step()
    assert not sched.prefill.waiting and len(sched.running) == 8
    run_until_idle(sched)
    assert_no_leak(sched)


def test_nothing_shared_means_nothing_deferred():
    reqs = make_requests(8, seed=12, prompt_len=(40, 60), max_new_tokens=4)
    expected = single_run_outputs(reqs, LONG_CONTEXT)
    for threshold in (32, 0):
        sched, col = _scheduler(in_batch_prefix_threshold=threshold)
        for req in reqs:
            sched.add_request(clone(req))
        order = order_waiting(sched.prefill.waiting, sched.config, sched.kv)
        assert order.deferred == [] and len(order.reqs) == 8
        batch = sched.schedule()
        assert batch is not None and len(batch.reqs) == 8
        sched.in_flight = sched.launch(batch)
        run_until_idle(sched)
        assert col.tokens == expected
        assert_no_leak(sched)


def test_short_shared_prefix_below_threshold_is_not_deferred():
    reqs = make_requests(4, seed=13, shared_prefix_len=20, prompt_len=(10, 20))
    sched, _ = _scheduler(in_batch_prefix_threshold=32)
    order = order_waiting(reqs, sched.config, sched.kv)
    assert order.deferred == [] and order.reqs == reqs
    sched, _ = _scheduler(in_batch_prefix_threshold=16)
    order = order_waiting(reqs, sched.config, sched.kv)
    assert order.reqs == reqs[:1] and order.deferred == reqs[1:]


def test_fcfs_and_disabled_cache_defer_nothing(burst):
    reqs, _ = burst
    for overrides in ({"schedule_policy": "fcfs"}, {"disable_radix_cache": True}):
        sched, _ = _scheduler(**overrides)
        order = order_waiting(list(reqs), sched.config, sched.kv)
        assert order.reqs == reqs and order.deferred == [] and order.num_matched == 0


def test_chunked_prefill_in_progress_holds_back_its_sharers():
    computing, *others = make_requests(3, seed=14, shared_prefix_len=80)
    unrelated = make_requests(1, seed=15)[0]
    queue = [*others, unrelated]  # nothing cached yet: prefix_indices are empty
    candidates, deferred = defer_shared_prefixes(queue, 32, computing)
    assert candidates == [unrelated] and deferred == others
    candidates, deferred = defer_shared_prefixes(queue, 32, None)
    assert candidates == [others[0], unrelated] and deferred == [others[1]]


def _cache_prompt(sched, ids: list[int]) -> None:
    sched.add_request(Req(rid=f"warm{len(ids)}-{ids[0]}", origin_input_ids=ids,
                          params=SamplingParams(max_new_tokens=0), prefill_only=True))
    run_until_idle(sched)


def _req(rid: str, ids: list[int]) -> Req:
    return Req(rid=rid, origin_input_ids=ids, params=SamplingParams(max_new_tokens=3, temperature=0.0))


def test_dfs_weight_orders_by_waiting_requests_per_branch():
    sched, _ = _scheduler(schedule_policy="dfs-weight")
    long_branch = [7] * 40  # cached, one request waits under it
    heavy_branch = [9] * 20  # cached, three requests wait under it
    deeper = heavy_branch + [4] * 10  # cached under the heavy branch
    for ids in ([*long_branch, 1], [*deeper, 1]):
        _cache_prompt(sched, ids)
    queue = [_req("fresh", [5, 6, 7]), _req("long", [*long_branch, 2, 3]), _req("heavy-a", [*heavy_branch, 3]),
             _req("deep", [*deeper, 8]), _req("heavy-b", [*heavy_branch, 6])]
    dfs = order_waiting(queue, sched.config, sched.kv)
    assert [r.rid for r in dfs.reqs] == ["deep", "heavy-a", "heavy-b", "long", "fresh"]
    lpm = order_waiting(queue, dataclasses.replace(sched.config, schedule_policy="lpm"), sched.kv)
    assert [r.rid for r in lpm.reqs] == ["long", "deep", "heavy-a", "heavy-b", "fresh"]


def test_dfs_weight_outputs_equal_single_runs():
    reqs = make_requests(6, seed=16, shared_prefix_len=40) + make_requests(4, seed=17, shared_prefix_len=10)
    expected = single_run_outputs(reqs, LONG_CONTEXT)
    sched, col = _scheduler(schedule_policy="dfs-weight", chunked_prefill_size=32)
    for req in reqs:
        sched.add_request(clone(req))
    run_until_idle(sched)
    assert col.tokens == expected
    assert_no_leak(sched)


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_policy_cost_is_bounded_by_the_window(policy, monkeypatch):
    sched, _ = _scheduler(schedule_policy=policy, schedule_policy_window=5)
    queue = make_requests(200, seed=18, shared_prefix_len=40)
    calls = []
    real = sched.kv.tree.match_prefix
    monkeypatch.setattr(sched.kv.tree, "match_prefix", lambda key: calls.append(1) or real(key))
    order = order_waiting(queue, sched.config, sched.kv)
    window = 5 if policy != "fcfs" else 0
    assert len(calls) == window
    assert order.num_matched == len(order.reqs) - (200 - window)
    assert order.reqs[order.num_matched:] == queue[window:], "past the window: arrival order"
    assert all(r.matched_node is None for r in queue[window:])


def test_long_queue_past_the_window_still_completes(burst):
    reqs, expected = burst
    sched, col = _scheduler(schedule_policy_window=2, max_running_requests=3)
    for req in reqs:
        sched.add_request(clone(req))
    run_until_idle(sched)
    assert col.tokens == expected
    assert_no_leak(sched)


def test_token_trie_longest_shared():
    trie = TokenTrie()
    assert trie.longest_shared([1, 2, 3]) == 0
    trie.insert([1, 2, 3, 4, 5])
    trie.insert([1, 2, 9])
    trie.insert([7])
    assert trie.longest_shared([1, 2, 3, 4, 5, 6]) == 5
    assert trie.longest_shared([1, 2, 3, 8]) == 3
    assert trie.longest_shared([1, 2, 9, 9]) == 3
    assert trie.longest_shared([1, 5]) == 1
    assert trie.longest_shared([7, 7]) == 1
    assert trie.longest_shared([]) == 0


def test_policies_are_registered_and_configurable():
    from radixmesh.engine.args import add_engine_args, engine_kwargs

    assert set(SCHEDULE_POLICIES) == set(PREFIX_ORDERS) | {"fcfs"}
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--schedule-policy", "dfs-weight", "--schedule-policy-window", "64",
                              "--in-batch-prefix-threshold", "0"])
    config = EngineConfig(**engine_kwargs(args))
    assert (config.schedule_policy, config.schedule_policy_window, config.in_batch_prefix_threshold) == \
        ("dfs-weight", 64, 0)
    for bad in ({"schedule_policy": "random"}, {"schedule_policy_window": 0}, {"in_batch_prefix_threshold": -1}):
        with pytest.raises(RadixMeshError):
            EngineConfig(**bad)
