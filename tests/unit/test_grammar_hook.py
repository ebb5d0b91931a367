"""The grammar hook on its own (engine/grammar/hook.py), over a stand-in grammar manager and scheduler: intake of
grammar requests, their masks, their tokens' verdicts and jump-forward. (test_grammar_scheduler.py runs real
grammars through a real scheduler.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.attention.base import ForwardMode
from radixmesh.engine.batch import ScheduleBatch
from radixmesh.engine.grammar.hook import GrammarHook, create_hook, grammar_rows
from radixmesh.engine.grammar.manager import GrammarManager
from radixmesh.engine.request import FinishReason, Req

from .manager_factory import req


class Matcher:
    def __init__(self, accepts: bool = True, terminated: bool = False) -> None:
        self.accepts, self.terminated = accepts, terminated

    def is_terminated(self) -> bool:
        return self.terminated


@dataclass
class FakeManager:
    """Stands in for GrammarManager: records what the hook asks of it."""

    jump_forward_enabled: bool = False
    compiling: list[Req] = field(default_factory=list)
    ready: list[Req] = field(default_factory=list)
    failed: list[tuple[Req, str]] = field(default_factory=list)
    refuse: str | None = None
    jump: list[int] | None = None
    masks: list[list[int]] = field(default_factory=list)
    waited: list[float] = field(default_factory=list)

    def submit(self, r: Req) -> None:
        if self.refuse:
            raise invalid_argument(self.refuse, "json_schema")
        self.compiling.append(r)

    @property
    def has_compiling(self) -> bool:
        return bool(self.compiling)

    def collect(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        out = self.ready, self.failed
        self.ready, self.failed = [], []
        return out

    def remove(self, rid: str) -> list[Req]:
        gone = [r for r in self.compiling if r.rid == rid]
        self.compiling = [r for r in self.compiling if r.rid != rid]
        return gone

    def wait(self, timeout_s: float) -> None:
        self.waited.append(timeout_s)

    def build_mask(self, reqs: list[Req], rows: list[int], device: Any) -> str:
        self.masks.append(rows)
        return f"mask{rows}"

    @staticmethod
    def accept(r: Req, token_id: int) -> bool:
        return bool(r.grammar.accepts)  # type: ignore[union-attr]

    def may_jump(self, r: Req) -> bool:
        return self.jump_forward_enabled and r.grammar is not None and not r.wants_logprobs

    def jump_forward(self, r: Req) -> list[int] | None:
        return self.jump

    def stats(self) -> dict[str, float]:
        return {"num_grammars_compiled": 0}


class FakeScheduler:
    """The part of the scheduler the hook talks to."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.running: list[Req] = []
        self.in_flight: Any = None
        self.runner = SimpleNamespace(device=torch.device("cpu"))
        self.results = SimpleNamespace(replace_last_token=self._replace)

    def fail(self, r: Req, message: str) -> None:
        self.log.append(f"fail {r.rid}: {message}")

    def enqueue(self, r: Req) -> None:
        self.log.append(f"enqueue {r.rid}")

    def requeue(self, r: Req) -> None:
        self.log.append(f"requeue {r.rid}")

    def process_in_flight(self) -> bool:
        self.log.append("process in flight")
        self.in_flight = None
        for r in self.running:  # the previous token lands: one future fewer
            if len(r.futures) > 1:
                r.futures.pop(0)
        return True

    def _replace(self, r: Req, new_ids: list[int]) -> None:
        self.log.append(f"replace {r.rid} {new_ids}")
        if 99 in new_ids:  # a stop string inside the forced text
            r.finish_reason = FinishReason.STOP


def make_hook(**manager: Any) -> tuple[GrammarHook, FakeManager, FakeScheduler]:
    fake, sched = FakeManager(**manager), FakeScheduler()
    return GrammarHook(sched, fake), fake, sched  # type: ignore[arg-type]


def constrained(rid: str, **kwargs: Any) -> Req:
    r = req(rid, json_schema='{"type": "object"}', **kwargs)
    r.grammar = Matcher()  # type: ignore[assignment]
    return r


def test_a_request_without_a_grammar_passes_through() -> None:
    hook, fake, _ = make_hook()
    assert hook.take_request(req("plain")) is False and fake.compiling == []


def test_a_grammar_request_waits_for_its_grammar_then_joins_the_queue() -> None:
    hook, fake, sched = make_hook()
    r = req("g", json_schema='{"type": "object"}')
    assert hook.take_request(r) and fake.compiling == [r] and hook.busy
    fake.compiling.clear()
    fake.ready = [r]
    bad = req("bad", json_schema="{")
    fake.failed = [(bad, "not JSON")]
    hook.on_step_start()
    assert sched.log == ["enqueue g", "fail bad: not JSON"] and not hook.busy


def test_a_grammar_the_manager_refuses_fails_the_request_at_intake() -> None:
    hook, _, sched = make_hook(refuse="too deep")
    assert hook.take_request(req("g", json_schema="{}")) is True  # taken: it fails here, never queued
    assert sched.log == ["fail g: too deep"]


def test_abort_and_idle_wait_while_compiling() -> None:
    hook, fake, _ = make_hook()
    assert hook.idle_wait(0.01) is False and fake.waited == []
    r = req("g", json_schema="{}")
    hook.take_request(r)
    assert hook.idle_wait(0.01) is True and fake.waited == [0.01]
    assert hook.remove("g") == [r] and not hook.busy


def test_host_tokens_are_needed_only_for_a_jump_with_a_token_in_flight() -> None:
    hook, fake, sched = make_hook(jump_forward_enabled=False)
    r = constrained("g")
    r.futures.append((1, 0))
    sched.running = [r]
    assert hook.needs_host_tokens(None) is False  # type: ignore[arg-type]  (jump-forward off: no scan)
    fake.jump_forward_enabled = True
    assert hook.needs_host_tokens(None) is True  # type: ignore[arg-type]
    r.futures.clear()
    assert hook.needs_host_tokens(None) is False  # type: ignore[arg-type]
    logprobs = constrained("lp", logprobs=True)
    logprobs.futures.append((1, 1))
    sched.running = [logprobs]
    assert hook.needs_host_tokens(None) is False  # type: ignore[arg-type]  (no jump with logprobs)


def batch_of(reqs: list[Req]) -> ScheduleBatch:
    return ScheduleBatch(ForwardMode.DECODE, reqs, [0] * len(reqs), [0] * len(reqs),
                         torch.zeros(len(reqs), dtype=torch.int64), [0] * len(reqs), [1] * len(reqs),
                         list(range(len(reqs))))


def test_masks_cover_the_rows_that_sample_under_a_grammar_in_this_launch() -> None:
    hook, fake, _ = make_hook()
    plain, g, stale = req("plain"), constrained("g"), constrained("stale")
    plain.futures.append((7, 0))
    g.futures.append((7, 1))
    stale.futures.append((6, 2))  # its future is another launch's
    batch = batch_of([plain, g, stale])
    assert grammar_rows(batch, 7) == [1]
    assert hook.vocab_mask(batch, 7) == "mask[1]" and fake.masks == [[1]]
    assert hook.vocab_mask(batch_of([plain]), 7) is None and fake.masks == [[1]]  # no grammar row: no cost


def test_under_overlap_the_previous_token_is_accepted_before_the_mask() -> None:
    hook, fake, sched = make_hook()
    g = constrained("g")
    g.futures += [(6, 0), (7, 0)]  # the previous launch's token is still on its way
    sched.running = [g]
    sched.in_flight = object()
    assert hook.vocab_mask(batch_of([g]), 7) == "mask[0]"
    assert sched.log == ["process in flight"] and fake.masks == [[0]]


def test_token_verdicts() -> None:
    hook, _, _ = make_hook()
    assert hook.token_verdict(req("plain"), 5) is None
    g = constrained("g")
    assert hook.token_verdict(g, 5) is None
    g.grammar = Matcher(terminated=True)  # type: ignore[assignment]
    assert hook.token_verdict(g, 5) == (FinishReason.STOP, 5)
    g.grammar = Matcher(accepts=False)  # type: ignore[assignment]
    assert hook.token_verdict(g, 9) == (FinishReason.ERROR, None)
    assert g.error == "the grammar refused token 9 (internal error)"


def test_a_jump_forward_requeues_the_request_to_prefill_the_forced_text() -> None:
    hook, _, sched = make_hook(jump_forward_enabled=True, jump=[40, 41])
    g = constrained("g")
    hook.after_tokens(g)
    assert sched.log == ["replace g [40, 41]", "requeue g"] and g.num_jumps == 1


def test_no_jump_for_finished_requests_without_forced_text_or_into_a_stop() -> None:
    hook, fake, sched = make_hook(jump_forward_enabled=True, jump=None)
    g = constrained("g")
    hook.after_tokens(g)  # nothing forced
    done = constrained("done")
    done.finish_reason = FinishReason.LENGTH
    fake.jump = [1, 2]
    hook.after_tokens(done)
    assert sched.log == [] and g.num_jumps == 0
    stops = constrained("stops")
    fake.jump = [98, 99]
    hook.after_tokens(stops)
    assert sched.log == ["replace stops [98, 99]"]  # finished by the forced text: not re-queued


def test_the_hook_is_always_on_with_the_managers_stats() -> None:
    from .scheduler_factory import make_scheduler

    sched, _ = make_scheduler()
    hook = sched.hooks.get(GrammarHook)
    assert hook is not None and isinstance(hook.manager, GrammarManager)
    assert hook.stats() == hook.manager.stats()
    assert isinstance(create_hook(sched), GrammarHook)
