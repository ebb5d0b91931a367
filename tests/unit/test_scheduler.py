"""Scheduler behaviour on a tiny random model: batching, chunking, retraction, abort, no leaks."""

from __future__ import annotations

import random

import pytest

from radixmesh.engine.request import Req
from radixmesh.wire.sampling import SamplingParams

from .scheduler_factory import assert_no_leak, clone, make_requests, make_scheduler, run_until_idle, single_run_outputs


@pytest.fixture(scope="module")
def workload() -> tuple[list[Req], dict[str, list[int]]]:
    reqs = make_requests(6, seed=1, shared_prefix_len=10) + make_requests(4, seed=2)
    return reqs, single_run_outputs(reqs)


@pytest.mark.parametrize("overrides", [
    {},
    {"schedule_policy": "fcfs"},
    {"chunked_prefill_size": 5},
    {"max_total_tokens": 90, "init_new_token_ratio": 0.05, "min_new_token_ratio": 0.05},
    {"max_total_tokens": 90, "chunked_prefill_size": 4, "max_running_requests": 3},
    {"disable_radix_cache": True},
    {"overlap_schedule": "on"},
    {"overlap_schedule": "on", "chunked_prefill_size": 5},
    {"overlap_schedule": "on", "max_total_tokens": 90, "init_new_token_ratio": 0.05, "min_new_token_ratio": 0.05},
], ids=["lpm", "fcfs", "chunked", "retract", "retract-chunked", "no-cache", "overlap", "overlap-chunked",
        "overlap-retract"])
def test_batched_outputs_equal_single_runs(workload, overrides):
    reqs, expected = workload
    sched, col = make_scheduler(**overrides)
    for req in reqs:
        sched.add_request(clone(req))
    run_until_idle(sched)
    assert col.tokens == expected
    assert all(col.finish[r.rid] == "length" for r in reqs)
    if "max_total_tokens" in overrides and "max_running_requests" not in overrides:
        assert sched.counters.num_retractions > 0
    assert_no_leak(sched)


def test_shared_prefix_reports_cached_tokens():
    sched, col = make_scheduler()
    first, second = make_requests(2, seed=3, shared_prefix_len=16)
    sched.add_request(first)
    run_until_idle(sched)
    sched.add_request(second)
    run_until_idle(sched)
    assert col.cached[first.rid] == 0
    assert col.cached[second.rid] >= 16
    assert_no_leak(sched)


def test_abort_queued_and_running_frees_kv():
    sched, col = make_scheduler(max_running_requests=2)
    reqs = make_requests(4, seed=4, max_new_tokens=50)
    for req in reqs:
        sched.add_request(req)
    for _ in range(3):
        sched.step()
    running = [r.rid for r in sched.running]
    assert running, "some request should be decoding"
    sched.abort(running[0])
    sched.abort(sched.prefill.waiting[0].rid)
    run_until_idle(sched)
    assert sum(1 for reason in col.finish.values() if reason == "abort") == 2
    assert len(col.finish) == 4
    assert_no_leak(sched)


def test_prompt_longer_than_context_is_rejected():
    sched, col = make_scheduler()
    req = Req(rid="long", origin_input_ids=[1] * 300, params=SamplingParams(max_new_tokens=2))
    sched.add_request(req)
    assert col.finish["long"] == "error" and "context length" in col.errors["long"]
    assert not sched.has_work


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_request_stops_at_context_end(overlap):
    sched, col = make_scheduler(overlap_schedule=overlap)
    req = Req(rid="edge", origin_input_ids=[3] * 250, params=SamplingParams(max_new_tokens=100, temperature=0))
    sched.add_request(req)
    run_until_idle(sched)
    assert col.finish["edge"] == "length"
    assert len(col.tokens["edge"]) == 6
    assert_no_leak(sched)


def test_prefill_only_request_caches_prompt():
    sched, col = make_scheduler()
    ids = list(range(1, 30))
    sched.add_request(Req(rid="warm", origin_input_ids=ids, params=SamplingParams(max_new_tokens=0),
                          prefill_only=True))
    run_until_idle(sched)
    assert col.tokens["warm"] == [] and col.finish["warm"] == "length"
    sched.add_request(Req(rid="a", origin_input_ids=ids, params=SamplingParams(max_new_tokens=3)))
    sched.add_request(Req(rid="b", origin_input_ids=ids, params=SamplingParams(max_new_tokens=3)))
    run_until_idle(sched)
    assert col.cached["a"] == col.cached["b"] == len(ids) - 1
    assert_no_leak(sched)


@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_with_aborts_never_leaks(seed):
    rng = random.Random(seed)
    sched, col = make_scheduler(max_total_tokens=rng.choice([80, 150, 400]),
                                overlap_schedule=rng.choice(["on", "off"]),
                                chunked_prefill_size=rng.choice([-1, 3, 16]),
                                schedule_policy=rng.choice(["lpm", "fcfs"]),
                                max_running_requests=rng.choice([2, 8]))
    reqs = make_requests(12, seed=seed, shared_prefix_len=rng.choice([0, 8]), max_new_tokens=rng.randint(1, 20))
    pending = list(reqs)
    steps = 0
    while pending or sched.has_work:
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop())
        if rng.random() < 0.1:
            sched.abort(rng.choice(reqs).rid)
        sched.step()
        steps += 1
        assert steps < 5000
    assert set(col.finish) == {r.rid for r in reqs}
    assert_no_leak(sched)
