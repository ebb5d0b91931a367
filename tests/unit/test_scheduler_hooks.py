"""The hook protocol (scheduler/hooks.py): which hooks a `HookSet` calls for each method, in which order, how
their answers combine, and where a real scheduler calls them in a step."""

from __future__ import annotations

from typing import Any

import pytest

from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.hooks import _METHODS, SCHEDULER_HOOKS, HookSet, SchedulerHook

from .scheduler_factory import make_requests, make_scheduler, run_until_idle, single_run_outputs


class Quiet(SchedulerHook):
    """Overrides nothing."""


class Busy(SchedulerHook):
    def __init__(self, busy: bool = True, waits: bool = True, flushes: bool = True) -> None:
        self._busy, self.waits, self.flushes = busy, waits, flushes
        self.waited: list[float] = []

    @property
    def busy(self) -> bool:
        return self._busy

    def idle_wait(self, timeout_s: float) -> bool:
        self.waited.append(timeout_s)
        return self.waits

    def flush(self) -> bool:
        return self.flushes


def test_the_protocol_lists_its_methods_and_defaults_do_nothing() -> None:
    assert set(_METHODS) == {"take_request", "remove", "on_step_start", "needs_host_tokens", "idle_wait",
                             "admissible", "decode_batch", "launch_scope", "launch", "vocab_mask", "on_launched",
                             "launch_deadline",
                             "on_results", "token_verdict", "settle", "after_tokens", "flush", "stats"}
    hook, r = Quiet(), Req(rid="r", origin_input_ids=[1], params=make_requests(1)[0].params)
    waiting = [r]
    assert hook.take_request(r) is False and hook.remove("r") == [] and hook.admissible(waiting) is waiting
    assert hook.idle_wait(1.0) is False and hook.busy is False and hook.flush() is True and hook.stats() == {}
    assert hook.launch_deadline() is None and hook.decode_batch([r]) is None and hook.token_verdict(r, 1) is None
    assert hook.launch_scope(None) is None  # type: ignore[arg-type]


def test_a_hook_set_calls_only_the_hooks_that_override_a_method() -> None:
    quiet, busy = Quiet(), Busy()
    hooks = HookSet([quiet, busy])
    assert hooks.overriding("idle_wait") == [busy] and hooks.overriding("on_step_start") == []
    assert hooks.overriding("flush") == [busy]
    assert list(hooks) == [quiet, busy] and hooks.get(Busy) is busy and hooks.get(Quiet) is quiet
    assert HookSet().get(Busy) is None


def test_answers_combine_any_all_and_first() -> None:
    idle, waiting = Busy(busy=False, waits=False), Busy(busy=True, waits=True)
    hooks = HookSet([idle, waiting])
    assert hooks.busy and hooks.idle_wait(0.5) and idle.waited == [0.5] and waiting.waited == [0.5]
    assert not HookSet([idle]).busy and not HookSet([idle]).idle_wait(0.1)
    assert HookSet([Busy(flushes=True), Busy(flushes=False)]).flush() is False
    assert HookSet().flush() is True and HookSet().launch_deadline() is None
    with HookSet([idle]).launch_scope(None):  # type: ignore[arg-type]  # (no hook gives one: an empty context)
        pass


def test_the_first_waiting_hook_ends_the_idle_wait() -> None:
    first, second = Busy(waits=True), Busy(waits=True)
    assert HookSet([first, second]).idle_wait(0.2)
    assert first.waited == [0.2] and second.waited == []  # one wait per idle step


class Deadline(SchedulerHook):
    def __init__(self, value: float | None) -> None:
        self.value = value

    def launch_deadline(self) -> float | None:
        return self.value


def test_the_first_proposal_wins_for_deadlines() -> None:
    assert HookSet([Deadline(None), Deadline(2.0), Deadline(1.0)]).launch_deadline() == 2.0
    assert HookSet([Deadline(None)]).launch_deadline() is None


class Named(SchedulerHook):
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def on_step_start(self) -> None:
        self.log.append(self.name)

    def stats(self) -> dict[str, Any]:
        return {"by": self.name, self.name: 1}


def test_order_is_the_order_added_and_first_goes_before_the_rest() -> None:
    log: list[str] = []
    hooks = HookSet([Named("a", log), Named("b", log)])
    hooks.add(Named("z", log), first=True)
    hooks.on_step_start()
    assert log == ["z", "a", "b"]
    assert hooks.stats() == {"by": "b", "z": 1, "a": 1, "b": 1}  # later hooks' keys win


class Holds(SchedulerHook):
    def __init__(self) -> None:
        self.held: list[Req] = []

    def take_request(self, req: Req) -> bool:
        if req.params.seed == 1:
            self.held.append(req)
            return True
        return False

    def remove(self, rid: str) -> list[Req]:
        gone = [r for r in self.held if r.rid == rid]
        self.held = [r for r in self.held if r.rid != rid]
        return gone


def test_intake_hooks_hold_requests_and_give_them_up_on_abort() -> None:
    sched, col = make_scheduler()
    holder = Holds()
    sched.hooks.add(holder)
    held, free = make_requests(2, seed=3)
    held.params = type(held.params)(max_new_tokens=4, temperature=0.0, seed=1)
    sched.add_request(held)
    sched.add_request(free)
    assert holder.held == [held] and [r.rid for r in sched.prefill.waiting] == [free.rid]
    sched.abort(held.rid)
    assert col.finish[held.rid] == "abort" and holder.held == []
    run_until_idle(sched)
    assert col.finish[free.rid] in ("length", "stop")


def test_a_request_that_cannot_run_is_refused_before_any_hook_sees_it() -> None:
    sched, col = make_scheduler()
    holder = Holds()
    sched.hooks.add(holder)
    empty = Req(rid="empty", origin_input_ids=[], params=make_requests(1)[0].params)
    sched.add_request(empty)
    assert col.errors["empty"] == "the prompt is empty" and holder.held == []


class StepLog(SchedulerHook):
    """Records where in a step the scheduler calls it."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def on_step_start(self) -> None:
        self.events.append("start")

    def admissible(self, waiting: list[Req]) -> list[Req]:
        self.events.append("admissible")
        return waiting

    def decode_batch(self, reqs: list[Req]) -> None:
        self.events.append("decode_batch")

    def vocab_mask(self, batch: Any, launch_id: int) -> None:
        self.events.append("mask")

    def on_launched(self, batch: Any) -> None:
        self.events.append("launched " + ("decode" if batch.is_decode else "extend"))

    def on_results(self, batch: Any) -> None:
        self.events.append("results " + ("decode" if batch.is_decode else "extend"))

    def settle(self, req: Req, host: Any, row: int) -> None:
        self.events.append("settle")

    def after_tokens(self, req: Req) -> None:
        self.events.append("after")


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_step_calls_the_hooks_at_their_points_and_changes_no_output(overlap: str) -> None:
    reqs = make_requests(1, seed=5, max_new_tokens=3)
    expected = single_run_outputs(reqs)
    sched, col = make_scheduler(overlap_schedule=overlap)
    log = StepLog()
    sched.hooks.add(log)
    sched.add_request(reqs[0])
    sched.step()  # the prefill
    if overlap == "off":
        assert log.events == ["start", "admissible", "mask", "launched extend", "results extend", "settle", "after"]
    else:  # its results are read at the next step
        assert log.events == ["start", "admissible", "mask", "launched extend"]
    log.events.clear()
    sched.step()  # the first decode step
    assert log.events[0] == "start" and "decode_batch" in log.events and "launched decode" in log.events
    run_until_idle(sched)
    assert col.tokens == expected
    settled = log.events.count("settle") + (1 if overlap == "off" else 0)  # (the prefill's was cleared above)
    assert settled == log.events.count("after") + (1 if overlap == "off" else 0) == 3  # once per token


def test_every_registered_hook_factory_imports_and_only_the_needed_ones_are_on() -> None:
    assert SCHEDULER_HOOKS.ids == ("step-trace", "launch-pacing", "decode-stream", "grammar", "host-tier",
                                   "speculative", "lora")
    for hook_id in SCHEDULER_HOOKS.ids:
        assert callable(SCHEDULER_HOOKS.load(hook_id))
    sched, _ = make_scheduler()  # CPU, no host tier, no speculation, no LoRA: the grammar hook alone
    assert [type(h).__name__ for h in sched.hooks] == ["GrammarHook"]
    assert sched.stats()["num_grammars_compiled"] == 0  # its stats are the scheduler's
