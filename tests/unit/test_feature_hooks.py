"""The host-tier, speculation and launch-pacing hooks on their own: what each does at its points of a step, and
when its factory turns it on (the scheduler names none of them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from radixmesh.engine.batch import LaunchedBatch
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.hicache import hook as host_tier
from radixmesh.engine.hicache.hook import HostTierHook
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler import pacing
from radixmesh.engine.scheduler.pacing import LaunchPacer, PacingHook
from radixmesh.engine.speculative import decoder as spec
from radixmesh.engine.speculative.decoder import SpecDecoder
from radixmesh.engine.speculative.verify_batch import VerifyBatch

from .manager_factory import req
from .scheduler_factory import make_scheduler


# ---- host tier ------------------------------------------------------------------------------------------
@dataclass
class FakeController:
    loading: bool = False
    busy: bool = False
    held: set[str] = field(default_factory=set)
    ticks: list[tuple[list[str], list[str], float]] = field(default_factory=list)
    waited: list[float] = field(default_factory=list)

    def tick(self, waiting: list[Req], running: list[Req], ratio: float) -> None:
        self.ticks.append(([r.rid for r in waiting], [r.rid for r in running], ratio))

    def ready(self, waiting: list[Req]) -> list[Req]:
        return [r for r in waiting if r.rid not in self.held]

    def wait(self, timeout_s: float) -> None:
        self.waited.append(timeout_s)

    def stats(self) -> dict[str, int]:
        return {"hicache_num_holds": len(self.held)}


def fake_sched(**attrs: Any) -> Any:
    return SimpleNamespace(prefill=SimpleNamespace(waiting=attrs.get("waiting", [])),
                           running=attrs.get("running", []), decode=SimpleNamespace(new_token_ratio=0.42),
                           config=attrs.get("config"), runner=attrs.get("runner"), kv=attrs.get("kv"),
                           needs_host_tokens=attrs.get("needs_host_tokens", lambda: False))


def test_the_host_tier_ticks_at_each_step_start_with_the_queue_and_the_ratio() -> None:
    controller = FakeController()
    sched = fake_sched(waiting=[req("w")], running=[req("r", first_id=20)])
    hook = HostTierHook(sched, controller)  # type: ignore[arg-type]
    hook.on_step_start()
    assert controller.ticks == [(["w"], ["r"], 0.42)]


def test_the_host_tier_leaves_loading_requests_out_and_waits_only_for_loads() -> None:
    controller = FakeController(held={"b"})
    hook = HostTierHook(fake_sched(), controller)  # type: ignore[arg-type]
    waiting = [req("a"), req("b", first_id=20)]
    assert [r.rid for r in hook.admissible(waiting)] == ["a"]
    assert hook.idle_wait(0.01) is False and controller.waited == []
    controller.loading = controller.busy = True
    assert hook.busy and hook.idle_wait(0.01) is True and controller.waited == [0.01]
    assert hook.stats() == {"hicache_num_holds": 1}


def test_the_host_tier_hook_is_on_exactly_with_a_host_tier() -> None:
    plain, _ = make_scheduler()
    assert host_tier.create_hook(plain) is None and plain.hooks.get(HostTierHook) is None
    tiered, _ = make_scheduler(max_total_tokens=200, enable_hierarchical_cache=True, hicache_ratio=2.0)
    hook = tiered.hooks.get(HostTierHook)
    assert hook is not None and hook.controller.kv is tiered.kv
    assert "hicache_host_hit_tokens" in tiered.stats()


# ---- speculation ----------------------------------------------------------------------------------------
@dataclass
class FakePolicy:
    speculates: bool = False
    asked: list[int] = field(default_factory=list)

    def speculate(self, batch_size: int) -> bool:
        self.asked.append(batch_size)
        return self.speculates


def bare_decoder(running: list[Req]) -> SpecDecoder:
    """A SpecDecoder without its proposer and verifier, for the decisions that need neither."""
    decoder = SpecDecoder.__new__(SpecDecoder)
    decoder.sched = fake_sched(running=running)
    decoder.policy = FakePolicy()  # type: ignore[assignment]
    return decoder


def test_speculation_needs_the_host_tokens_after_a_verification_or_before_drafting() -> None:
    decoder = bare_decoder(running=[req("a"), req("b", first_id=20)])
    plain = LaunchedBatch(1, object(), object())  # type: ignore[arg-type]
    verify = LaunchedBatch(2, VerifyBatch.__new__(VerifyBatch), object())  # type: ignore[arg-type]
    assert decoder.needs_host_tokens(verify) is True and decoder.policy.asked == []  # type: ignore[attr-defined]
    assert decoder.needs_host_tokens(plain) is False and decoder.policy.asked == [2]  # type: ignore[attr-defined]
    decoder.policy.speculates = True  # type: ignore[attr-defined]
    assert decoder.needs_host_tokens(plain) is True
    assert bare_decoder(running=[]).needs_host_tokens(plain) is False  # nobody to draft for


def test_speculation_launches_only_its_own_batches() -> None:
    decoder = bare_decoder(running=[])
    assert decoder.launch(object(), 3) is None  # type: ignore[arg-type]  (the model runner's)


def test_the_speculation_hook_is_on_exactly_with_an_algorithm(monkeypatch: pytest.MonkeyPatch) -> None:
    plain, _ = make_scheduler()
    assert spec.create_hook(plain) is None and plain.hooks.get(SpecDecoder) is None
    made: list[Any] = []
    monkeypatch.setattr(SpecDecoder, "create", classmethod(lambda cls, sched: made.append(sched) or "decoder"))
    on = SimpleNamespace(config=SimpleNamespace(speculative_algorithm="ngram"))
    assert spec.create_hook(on) == "decoder" and made == [on]  # type: ignore[arg-type]


def test_a_speculating_scheduler_holds_its_decoder_as_a_hook() -> None:
    sched, _ = make_scheduler(speculative_algorithm="ngram")
    decoder = sched.hooks.get(SpecDecoder)
    assert decoder is not None and decoder.sched is sched
    assert [type(h).__name__ for h in sched.hooks] == ["GrammarHook", "SpecDecoder"]
    assert "spec_accept_rate" in sched.stats() and sched.flush_cache()


# ---- launch pacing --------------------------------------------------------------------------------------
class FakePacer:
    def __init__(self, deadline: float | None = None) -> None:
        self.events: list[tuple[str, bool, float]] = []
        self._deadline = deadline

    def launched(self, is_decode: bool, host_s: float) -> None:
        self.events.append(("launched", is_decode, host_s))

    def results_read(self, is_decode: bool) -> None:
        self.events.append(("read", is_decode, 0.0))

    def deadline(self) -> float | None:
        return self._deadline


def test_pacing_times_the_host_from_the_step_start_to_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([10.0, 10.004, 20.0, 20.001])
    monkeypatch.setattr(pacing.time, "perf_counter", lambda: next(clock))
    fake = FakePacer()
    hook = PacingHook(fake_sched(), fake)  # type: ignore[arg-type]
    decode, extend = SimpleNamespace(is_decode=True), SimpleNamespace(is_decode=False)
    hook.on_step_start()
    hook.on_launched(decode)  # type: ignore[arg-type]
    hook.on_results(decode)  # type: ignore[arg-type]
    hook.on_step_start()
    hook.on_launched(extend)  # type: ignore[arg-type]
    assert [(e[0], e[1]) for e in fake.events] == [("launched", True), ("read", True), ("launched", False)]
    assert fake.events[0][2] == pytest.approx(0.004) and fake.events[2][2] == pytest.approx(0.001)


def test_pacing_holds_a_launch_only_when_no_token_must_reach_the_host_first() -> None:
    need = [False]
    hook = PacingHook(fake_sched(needs_host_tokens=lambda: need[0]), FakePacer(deadline=5.0))  # type: ignore[arg-type]
    assert hook.launch_deadline() == 5.0
    need[0] = True
    assert hook.launch_deadline() is None
    assert PacingHook(fake_sched(), FakePacer(deadline=None)).launch_deadline() is None  # type: ignore[arg-type]


@pytest.mark.parametrize(("device", "overrides", "on"), [
    ("cuda", {}, True), ("cpu", {}, False), ("cuda", {"disable_launch_pacing": True}, False),
    ("cuda", {"overlap_schedule": "off"}, False), ("cuda", {"speculative_algorithm": "ngram"}, False)])
def test_pacing_is_on_where_cuda_launches_overlap_without_speculation(
        monkeypatch: pytest.MonkeyPatch, device: str, overrides: dict[str, Any], on: bool) -> None:
    monkeypatch.setattr(LaunchPacer, "create", staticmethod(
        lambda config, dev: LaunchPacer(object()) if dev.type == "cuda" and config.overlap_enabled
        and not config.disable_launch_pacing else None))
    config = EngineConfig(**{"device": "cpu", "overlap_schedule": "on", **overrides})
    sched = SimpleNamespace(config=config, runner=SimpleNamespace(device=SimpleNamespace(type=device)))
    hook = pacing.create_hook(sched)  # type: ignore[arg-type]
    assert (hook is not None) is on
