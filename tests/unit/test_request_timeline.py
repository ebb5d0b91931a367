"""A Generate call's phases in the worker front end (worker/timeline.py) and its load (worker/load.py): the queue
wait and inter-token gaps observed from the scheduler's outputs, and the tokens the worker reports as queued
prefill work and running decode work."""

from __future__ import annotations

import time

import pytest

from radixmesh.wire.messages import TokenOut
from radixmesh.worker.load import LoadTracker
from radixmesh.worker.timeline import RequestTimeline


class Recorded:
    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, amount: float) -> None:
        self.values.append(amount)


def out(ids: list[int], admitted_at: float | None = None, finish: str | None = None, completion: int = 0,
        cached: int = 0) -> TokenOut:
    return TokenOut("r", ids, 8, cached, completion, finish_reason=finish, admitted_at=admitted_at)


def test_the_queue_wait_is_observed_once_from_the_admission_stamp() -> None:
    queue, itl = Recorded(), Recorded()
    timeline = RequestTimeline("r", 8, queue_time=queue, itl=itl)
    admitted = time.time() + 0.05  # admitted 50 ms after the call arrived
    timeline.on_output(out([1], admitted_at=admitted, completion=1))
    timeline.on_output(out([2], admitted_at=admitted + 1, completion=2))
    assert len(queue.values) == 1 and 0.03 <= queue.values[0] <= 5.0


def test_an_admission_stamp_before_the_arrival_counts_as_no_wait() -> None:
    queue = Recorded()
    timeline = RequestTimeline("r", 8, queue_time=queue, itl=None)
    timeline.on_output(out([1], admitted_at=time.time() - 10))
    assert queue.values == [0.0]


def test_inter_token_gaps_are_spread_over_the_tokens_of_a_message() -> None:
    itl = Recorded()
    timeline = RequestTimeline("r", 8, queue_time=None, itl=itl)
    timeline.on_output(out([1], completion=1))  # the first token: no gap
    assert itl.values == []
    time.sleep(0.02)
    timeline.on_output(out([2, 3, 4], completion=4))  # three tokens in one message: three equal gaps
    assert len(itl.values) == 3 and itl.values[0] == itl.values[1] == itl.values[2] > 0
    timeline.on_output(out([], finish="length", completion=4))  # the last message may carry no token
    assert len(itl.values) == 3 and timeline.finish_reason == "length" and timeline.num_output_tokens == 4


def test_the_timeline_keeps_what_the_spans_report() -> None:
    timeline = RequestTimeline("r", 8, queue_time=None, itl=None)
    load = (time.time(), time.time() + 0.01, 16)
    timeline.on_output(TokenOut("r", [1], 8, 5, 1, admitted_at=time.time(), host_load=load))
    timeline.on_output(TokenOut("r", [2], 8, 5, 2))
    assert timeline.cached_tokens == 5 and timeline.host_load == load and timeline.first_token_ns is not None
    assert timeline.last_token_ns is not None and timeline.last_token_ns >= timeline.first_token_ns
    timeline.close()  # tracing off: nothing to record, nothing raised


def test_load_counts_queued_prompts_until_their_first_token_then_decode_tokens() -> None:
    load = LoadTracker()
    with load.track("a", 100) as a, load.track("b", 40) as b:
        assert load.num_queued_prefill_tokens == 140 and load.num_running_decode_tokens == 0
        load.update(a, 1)
        assert load.num_queued_prefill_tokens == 40 and load.num_running_decode_tokens == 101
        load.update(a, 3)
        load.update(b, 2)
        assert load.num_queued_prefill_tokens == 0 and load.num_running_decode_tokens == 104 + 42
        assert set(load.active) == {"a", "b"}
    assert load.active == {} and load.num_queued_prefill_tokens == load.num_running_decode_tokens == 0


def test_a_sequence_leaves_the_load_even_when_its_call_fails() -> None:
    load = LoadTracker()
    with pytest.raises(RuntimeError), load.track("a", 10):
        raise RuntimeError("the scheduler went away")
    assert load.active == {}
