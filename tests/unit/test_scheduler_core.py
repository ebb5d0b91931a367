"""The scheduler as a composer (scheduler/core.py): what one step does, the one place a launched batch is
processed, the public API the loop, the hooks and disaggregation use, and its counters."""

from __future__ import annotations

from typing import Any

import pytest

from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.hooks import SchedulerHook
from radixmesh.wire.sampling import SamplingParams

from .scheduler_factory import assert_no_leak, make_requests, make_scheduler, run_until_idle, single_run_outputs


def test_an_idle_step_does_nothing() -> None:
    sched, col = make_scheduler()
    assert not sched.has_work and sched.step() is False and col.tokens == {}
    assert sched.counters.num_forward_passes == 0


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_each_step_launches_at_most_one_batch_and_processes_the_one_before(overlap: str) -> None:
    sched, col = make_scheduler(overlap_schedule=overlap)
    (r,) = make_requests(1, seed=2, max_new_tokens=3)
    sched.add_request(r)
    assert sched.step() is True and sched.counters.num_forward_passes == 1
    if overlap == "on":
        assert sched.in_flight is not None and col.tokens == {}  # read back at the next step
    else:
        assert sched.in_flight is None and len(col.tokens[r.rid]) == 1
    run_until_idle(sched)
    assert len(col.tokens[r.rid]) == 3 and sched.counters.num_forward_passes == 3
    assert_no_leak(sched)


def test_processing_in_flight_is_one_place_and_reports_whether_there_was_a_batch() -> None:
    sched, col = make_scheduler(overlap_schedule="on")
    assert sched.process_in_flight() is False
    (r,) = make_requests(1, seed=3, max_new_tokens=2)
    sched.add_request(r)
    sched.step()
    launched = sched.in_flight
    assert launched is not None
    assert sched.process_in_flight() is True and sched.in_flight is None and len(col.tokens[r.rid]) == 1
    sentinel: Any = launched
    assert sched.process_in_flight(then=sentinel) is False and sched.in_flight is sentinel
    sched.in_flight = None
    run_until_idle(sched)


def test_penalties_need_the_previous_token_before_the_next_step() -> None:
    sched, _ = make_scheduler(overlap_schedule="on")
    (plain,) = make_requests(1, seed=4, max_new_tokens=4)
    (penalized,) = make_requests(1, seed=5, max_new_tokens=4, frequency_penalty=0.5)
    sched.add_request(plain)
    sched.step()
    assert not sched.needs_host_tokens()
    sched.add_request(penalized)
    while not penalized.futures:
        sched.step()
    assert sched.needs_host_tokens()
    run_until_idle(sched)


class Pace(SchedulerHook):
    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline

    def launch_deadline(self) -> float | None:
        return self.deadline


def test_a_launch_is_held_only_with_a_decode_step_on_the_device_and_nobody_waiting() -> None:
    sched, _ = make_scheduler(overlap_schedule="on")
    sched.hooks.add(Pace(123.0))
    assert sched.launch_deadline() is None  # nothing in flight
    reqs = make_requests(2, seed=6, max_new_tokens=6)
    sched.add_request(reqs[0])
    sched.step()  # the prefill is in flight
    assert sched.launch_deadline() is None
    sched.step()  # a decode step is in flight
    assert sched.in_flight is not None and sched.in_flight.batch.is_decode and sched.launch_deadline() == 123.0
    sched.add_request(reqs[1])
    assert sched.launch_deadline() is None  # a request waits for admission
    run_until_idle(sched)


def test_requests_move_between_the_parts_through_the_public_api() -> None:
    sched, col = make_scheduler()
    a, b = make_requests(2, seed=7, max_new_tokens=5)
    sched.enqueue(a)
    assert sched.prefill.waiting == [a]
    sched.step()
    assert sched.running == [a]
    sched.requeue(a)  # back to the front, its KV cached
    assert sched.running == [] and sched.prefill.waiting[0] is a and a.req_pool_idx is None
    sched.fail(b, "refused here")
    assert col.errors[b.rid] == "refused here" and col.finish[b.rid] == "error"
    run_until_idle(sched)
    assert col.finish[a.rid] in ("length", "stop")
    assert_no_leak(sched)


def test_a_prefilled_request_joins_decoding_with_its_first_token() -> None:
    (r,) = make_requests(1, seed=8, max_new_tokens=4)
    expected = single_run_outputs([r])[r.rid]
    sched, col = make_scheduler()
    req = Req(rid=r.rid, origin_input_ids=list(r.origin_input_ids), params=r.params)
    sched.kv.match(req)
    sched.kv.lock(req)
    assert sched.kv.assign_row(req)
    slots = sched.kv.alloc_slots(len(req.origin_input_ids))
    assert slots is not None and req.req_pool_idx is not None
    sched.kv.req_pool.write(req.req_pool_idx, 0, slots)
    # (this KV holds nothing computed: the continuation differs; what is checked is where the request goes)
    sched.commit_prefilled(req, 3, expected[0])
    assert sched.running == [req] and col.tokens[r.rid] == [expected[0]] and col.cached[r.rid] == 3
    assert sched.counters.num_prompt_tokens == len(r.origin_input_ids) and sched.counters.num_cached_tokens == 3
    run_until_idle(sched)
    assert len(col.tokens[r.rid]) == 4
    assert_no_leak(sched)


def test_abort_finds_a_request_wherever_it_is() -> None:
    sched, col = make_scheduler(chunked_prefill_size=4, schedule_policy="fcfs")
    (running,) = make_requests(1, seed=9, max_new_tokens=50, prompt_len=(3, 3))
    chunked, waiting = make_requests(2, seed=19, max_new_tokens=50, prompt_len=(10, 10))
    sched.add_request(running)
    sched.step()
    assert sched.running == [running]
    sched.add_request(chunked)
    sched.step()
    assert sched.prefill.chunked_req is chunked
    sched.add_request(waiting)
    for r in (waiting, running, chunked):
        sched.abort(r.rid)
        assert col.finish[r.rid] == "abort"
    assert not sched.has_work and sched.prefill.chunked_req is None
    assert_no_leak(sched)


class Held(SchedulerHook):
    def __init__(self) -> None:
        self.busy_now = True

    @property
    def busy(self) -> bool:
        return self.busy_now


def test_a_busy_hook_keeps_the_scheduler_stepping_and_the_cache_unflushed() -> None:
    sched, _ = make_scheduler()
    hook = Held()
    sched.hooks.add(hook)
    assert sched.has_work and sched.flush_cache() is False
    hook.busy_now = False
    assert not sched.has_work and sched.flush_cache() is True


def test_an_empty_or_too_long_prompt_fails_at_once() -> None:
    sched, col = make_scheduler(max_total_tokens=64)
    params = SamplingParams(max_new_tokens=2)
    sched.add_request(Req(rid="empty", origin_input_ids=[], params=params))
    sched.add_request(Req(rid="long", origin_input_ids=[1] * 300, params=params))
    sched.add_request(Req(rid="big", origin_input_ids=[1] * 64, params=params))
    assert col.errors["empty"] == "the prompt is empty"
    assert "the context length is 256" in col.errors["long"]
    assert "the KV cache holds 64" in col.errors["big"]
    assert not sched.has_work


def test_counters_and_the_ratio_reset_together() -> None:
    sched, _ = make_scheduler()
    for r in make_requests(3, seed=10, max_new_tokens=4):
        sched.add_request(r)
    run_until_idle(sched)
    stats = sched.stats()
    assert stats["num_generated_tokens"] == 12 and stats["num_forward_passes"] > 0
    assert stats["num_prompt_tokens"] == sched.counters.num_prompt_tokens > 0
    assert stats["new_token_ratio"] < sched.config.init_new_token_ratio
    sched.reset_counters()
    assert sched.counters.num_generated_tokens == sched.counters.num_forward_passes == 0
    assert sched.decode.new_token_ratio == sched.config.init_new_token_ratio
    assert sched.stats()["cache_hit_rate"] == 0.0


def test_stats_count_a_chunked_prompt_as_running() -> None:
    sched, _ = make_scheduler(chunked_prefill_size=4)
    (r,) = make_requests(1, seed=11, prompt_len=(12, 12))
    sched.add_request(r)
    sched.step()
    stats = sched.stats()
    assert stats["num_running_reqs"] == 1 and stats["num_waiting_reqs"] == 0
    run_until_idle(sched)
