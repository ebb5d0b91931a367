"""Holding the next decode launch while a step runs on the device (scheduler/pacing.py), on a fake CUDA clock."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import zmq

from radixmesh.engine.scheduler import pacing as launch_pacing
from radixmesh.engine.scheduler.loop import SchedulerLoop
from radixmesh.engine.scheduler.pacing import MIN_MARGIN_S, LaunchPacer, PacingHook

from .scheduler_factory import assert_no_leak, clone, make_requests, make_scheduler, run_until_idle, single_run_outputs


class FakeEvent:
    """A CUDA event recorded at the fake device's clock; complete once the device got past it."""

    def __init__(self, clock: FakeCuda) -> None:
        self.clock = clock
        self.at_ms: float | None = None

    def record(self) -> None:
        self.at_ms = self.clock.now_ms

    def query(self) -> bool:
        return self.at_ms is not None and self.at_ms <= self.clock.done_ms

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time of an event that did not complete"
        assert self.at_ms is not None and end.at_ms is not None
        return end.at_ms - self.at_ms


class FakeCuda:
    def __init__(self) -> None:
        self.now_ms = 0.0  # device time at which the next event records
        self.done_ms = -1.0  # events recorded at or before this have completed

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # (torch.cuda.Event)
        assert enable_timing
        return FakeEvent(self)


def decode_launch(pacer: LaunchPacer, cuda: FakeCuda, device_ms: float, host_s: float = 0.0005) -> None:
    """A decode step of `device_ms` queued behind whatever the device still runs."""
    cuda.now_ms += device_ms
    pacer.launched(True, host_s)


def test_no_deadline_until_a_step_queued_behind_another_was_timed() -> None:
    cuda = FakeCuda()
    pacer = LaunchPacer(cuda)
    assert pacer.deadline() is None
    decode_launch(pacer, cuda, 7.0)  # the first step: nothing before it to measure from
    decode_launch(pacer, cuda, 7.0)  # queued while the first still runs (done_ms is behind)
    pacer.results_read(is_decode=True)  # neither completed yet: no estimate
    assert pacer.step_s is None and pacer.deadline() is None
    cuda.done_ms = cuda.now_ms
    pacer.results_read(is_decode=True)
    assert pacer.step_s == pytest.approx(0.007)
    deadline = pacer.deadline()
    assert deadline is not None and pacer.last_done is not None
    assert deadline == pytest.approx(pacer.last_done + 0.007 - 0.0005 - MIN_MARGIN_S)


def test_only_back_to_back_steps_are_timed_and_idle_devices_widen_the_margin() -> None:
    """A step launched onto an idle device is not timed (its interval would hold host time) and makes the next
    holds shorter; steps queued behind running ones are timed and narrow the margin back."""
    cuda = FakeCuda()
    pacer = LaunchPacer(cuda)
    for device_ms in (7.0, 7.0, 7.0, 9.0):
        decode_launch(pacer, cuda, device_ms)
    cuda.done_ms = cuda.now_ms
    pacer.results_read(is_decode=True)
    assert pacer.step_s == pytest.approx(0.001 * (0.8 * (0.8 * 7 + 0.2 * 7) + 0.2 * 9))
    assert pacer.extra_margin_s == 0.0
    estimate = pacer.step_s
    cuda.now_ms += 50.0  # the host held the next launch too long: the device ran dry
    cuda.done_ms = cuda.now_ms
    decode_launch(pacer, cuda, 7.0)
    assert pacer.extra_margin_s == pytest.approx(launch_pacing.BUBBLE_MARGIN_S)
    cuda.done_ms = cuda.now_ms
    pacer.results_read(is_decode=True)
    assert pacer.step_s == estimate, "a step after an idle gap was timed"
    cuda.done_ms = cuda.now_ms - 1.0  # the device still runs that step
    decode_launch(pacer, cuda, 7.0)
    assert pacer.extra_margin_s == pytest.approx(0.9 * launch_pacing.BUBBLE_MARGIN_S)


def test_a_prefill_in_between_or_a_long_step_means_launch_now(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda()
    pacer = LaunchPacer(cuda)
    decode_launch(pacer, cuda, 7.0)
    decode_launch(pacer, cuda, 7.0)
    cuda.done_ms = cuda.now_ms
    pacer.results_read(is_decode=True)
    assert pacer.deadline() is not None
    cuda.now_ms += 50.0
    pacer.launched(False, 0.001)  # a prefill: the next decode step's interval would include it
    decode_launch(pacer, cuda, 7.0)
    cuda.done_ms = cuda.now_ms
    pacer.results_read(is_decode=False)
    assert pacer.step_s == pytest.approx(0.007) and pacer.deadline() is None
    pacer.results_read(is_decode=True)
    monkeypatch.setattr(launch_pacing, "MAX_HOLD_S", 0.005)
    assert pacer.deadline() is None


def test_scheduler_holds_only_a_decode_step_with_nobody_waiting() -> None:
    reqs = make_requests(3, seed=7, max_new_tokens=10)
    expected = single_run_outputs(reqs)
    sched, col = make_scheduler(overlap_schedule="on")
    assert sched.hooks.get(PacingHook) is None  # (a CPU device: nothing to pace)
    assert sched.launch_deadline() is None
    cuda = FakeCuda()
    sched.hooks.add(PacingHook(sched, LaunchPacer(cuda)), first=True)
    for req in reqs:
        sched.add_request(clone(req))
    held = []
    while sched.has_work:
        cuda.now_ms += 1.0  # each launch records one millisecond after the one before
        cuda.done_ms = cuda.now_ms - 1.5  # and the device still runs the last one launched
        deadline = sched.launch_deadline()
        in_flight = sched.in_flight
        if deadline is not None:
            held.append(deadline)
            assert not sched.prefill.waiting and in_flight is not None and in_flight.batch.is_decode
        sched.step()
    assert held, "no decode launch was ever held"
    assert col.tokens == expected  # holding launches changes when, never what
    extra = clone(make_requests(1, seed=8)[0])
    sched.add_request(extra)
    assert sched.launch_deadline() is None  # a request waits for admission
    run_until_idle(sched)
    assert_no_leak(sched)


def test_loop_listens_until_the_deadline_and_takes_a_request_at_once() -> None:
    ctx: zmq.Context[Any] = zmq.Context.instance()
    recv, send = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = recv.bind_to_random_port("tcp://127.0.0.1")
    send.connect(f"tcp://127.0.0.1:{port}")
    poller = zmq.Poller()
    poller.register(recv, zmq.POLLIN)
    loop = SchedulerLoop(scheduler=None, send=send)  # type: ignore[arg-type]
    drained: list[bytes] = []

    def drain(sock: Any) -> None:
        while True:
            try:
                drained.append(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return

    loop._drain = drain
    try:
        start = time.perf_counter()
        loop._listen_until(poller, recv, start + 0.08)
        waited = time.perf_counter() - start
        # held; 0.5 s: a loaded machine, still catching a unit slip (80 s) or a wait for a message
        assert 0.06 <= waited <= 0.5 and not drained
        timer = threading.Timer(0.02, lambda: send.send(b"request"))
        timer.start()
        start = time.perf_counter()
        loop._listen_until(poller, recv, start + 10.0)
        waited = time.perf_counter() - start
        timer.join()
        # taken at once, not at the 10 s deadline (5 s: a loaded machine may start the timer late)
        assert drained == [b"request"] and waited < 5.0, f"waited {waited:.3f} s for an arrived request"
        start = time.perf_counter()
        loop._listen_until(poller, recv, start - 0.01)  # a deadline already past: no wait (a poll with a
        assert time.perf_counter() - start < 0.5  # negative timeout would block for good; 0.5 s: a loaded machine)
    finally:
        recv.close(0)
        send.close(0)


def test_a_pacer_by_default_on_an_overlapping_cuda_device_unless_disabled() -> None:
    from types import SimpleNamespace

    from radixmesh.engine.config import EngineConfig

    cuda, cpu = SimpleNamespace(type="cuda"), SimpleNamespace(type="cpu")
    on = EngineConfig(device="cpu", overlap_schedule="on")
    assert isinstance(LaunchPacer.create(on, cuda), LaunchPacer)
    assert LaunchPacer.create(on, cpu) is None
    assert LaunchPacer.create(EngineConfig(device="cpu", overlap_schedule="on", disable_launch_pacing=True),
                              cuda) is None
    assert LaunchPacer.create(EngineConfig(device="cpu", overlap_schedule="off"), cuda) is None


def test_the_flag_turns_pacing_off() -> None:
    from radixmesh.cli import build_parser
    from radixmesh.engine.args import engine_kwargs

    args = build_parser("generate").parse_args(["generate", "--disable-launch-pacing", "--prompt", "hi"])
    assert engine_kwargs(args)["disable_launch_pacing"] is True
    args = build_parser("generate").parse_args(["generate", "--prompt", "hi"])
    assert engine_kwargs(args)["disable_launch_pacing"] is False
