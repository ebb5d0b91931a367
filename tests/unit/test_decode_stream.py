"""Prefills beside the running decode step (scheduler/decode_stream.py): which launches go where, when the main stream
waits for the decode step, on the CPU scheduler with a recording stand-in for the two CUDA streams."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from radixmesh.engine.attention.triton_backend import TritonBackend
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.sampling.batch_info import SamplingInfoCache
from radixmesh.engine.scheduler import decode_stream
from radixmesh.engine.scheduler.decode_stream import DecodeStreamHook
from radixmesh.engine.scheduler.pacing import LaunchPacer
from radixmesh.wire.sampling import SamplingParams

from .scheduler_factory import assert_no_leak, clone, make_requests, make_scheduler
from .test_launch_pacing import FakeCuda, decode_launch


class StepEvent:
    def __init__(self, log: list[str], n: int, done: bool) -> None:
        self.log, self.n, self.is_done = log, n, done


class RecordingStreams:
    """What the hook asks of the CUDA streams, in order, in `log` (shared with the pools' frees)."""

    def __init__(self, log: list[str], steps_done: bool = False) -> None:
        self.log = log
        self.steps_done = steps_done
        self.num_steps = 0
        self.on_decode = False
        self.kept: list[Any] = []

    def enter_decode(self) -> None:
        assert not self.on_decode
        self.on_decode = True
        self.log.append("decode-waits-main")

    def exit_decode(self) -> StepEvent:
        assert self.on_decode
        self.on_decode = False
        self.num_steps += 1
        self.log.append(f"step-{self.num_steps}")
        return StepEvent(self.log, self.num_steps, self.steps_done)

    def done(self, event: StepEvent) -> bool:
        return event.is_done

    def main_waits(self, event: StepEvent) -> None:
        self.log.append(f"main-waits-step-{event.n}")

    def keep_for_decode(self, tensor: Any) -> None:
        self.kept.append(tensor)


def _hooked_scheduler(steps_done: bool = False, **overrides: Any) -> tuple[Any, Any, DecodeStreamHook, list[str]]:
    sched, col = make_scheduler(overlap_schedule="on", **overrides)
    log: list[str] = []
    hook = DecodeStreamHook(sched, RecordingStreams(log, steps_done))  # type: ignore[arg-type]
    sched.hooks.add(hook)
    free, row_free = sched.kv.allocator.free, sched.kv.req_pool.free

    def logged_free(slots: torch.Tensor) -> None:
        log.append("free-slots")
        free(slots)

    def logged_row_free(idx: Any) -> None:
        log.append("free-row")
        row_free(idx)

    sched.kv.allocator.free = logged_free  # type: ignore[method-assign]
    sched.kv.req_pool.free = logged_row_free  # type: ignore[method-assign]
    return sched, col, hook, log


def _staggered(sched: Any, early: list[Any], late: list[Any], late_at: int) -> None:
    for req in early:
        sched.add_request(clone(req))
    steps = 0
    while sched.has_work or steps <= late_at:
        if steps == late_at:
            for req in late:
                sched.add_request(clone(req))
        sched.step()
        steps += 1
        assert steps < 500


def _requests() -> tuple[list[Any], list[Any]]:
    early = make_requests(3, seed=3, max_new_tokens=16)
    early[0].params = SamplingParams(max_new_tokens=5, temperature=0.0)  # finishes while the others decode
    late = make_requests(2, seed=4, max_new_tokens=6)
    return early, late


def test_prefills_run_beside_a_running_step_and_releases_wait_for_it() -> None:
    early, late = _requests()
    sched, col, hook, log = _hooked_scheduler()
    _staggered(sched, early, late, late_at=8)
    plain, plain_col = make_scheduler(overlap_schedule="on")
    _staggered(plain, early, late, late_at=8)
    assert col.tokens == plain_col.tokens  # the same batches: the hook moves launches, not decisions
    assert_no_leak(sched)
    # the late prompts' prefill came while decode steps ran and did not wait for them
    assert hook.num_beside >= 1 and hook.num_waited == 0
    # every decode launch first waited for the main stream
    assert log.count("decode-waits-main") == hook.streams.num_steps > 10  # type: ignore[attr-defined]
    # every free came after the main stream waited for the last step launched before it (the step that may still
    # write the freed slots): one wait per step, the first release waits, the others are behind it
    assert 0 < hook.num_release_waits <= len(early) + len(late)
    frees = [i for i, e in enumerate(log) if e.startswith("free")]
    assert frees
    for i in frees:
        launched = [e for e in log[:i] if e.startswith("step-")]
        if launched:
            assert f"main-waits-{launched[-1]}" in log[:i], f"a free while {launched[-1]} ran: {log[i - 4:i + 1]}"
    # after a prefill, the next decode step reads its sampled tokens: kept for the decode stream
    assert hook.streams.kept, "the prefill's tokens were not recorded on the decode stream"  # type: ignore[attr-defined]
    assert sched.stats()["num_prefills_beside_decode"] == hook.num_beside


def test_nothing_waits_once_the_step_completed() -> None:
    early, late = _requests()
    sched, col, hook, log = _hooked_scheduler(steps_done=True)
    _staggered(sched, early, late, late_at=8)
    assert not any(e.startswith("main-waits") for e in log)
    assert hook.num_beside == hook.num_waited == hook.num_release_waits == 0
    assert len(col.finish) == 5
    assert_no_leak(sched)


def test_a_prefill_of_tokens_still_on_the_device_waits() -> None:
    _, _, hook, log = _hooked_scheduler()
    hook.step_end = StepEvent(log, 7, done=False)
    hook.launch_scope(SimpleNamespace(is_decode=False, future_rows=[0]))  # type: ignore[arg-type]
    assert log == ["main-waits-step-7"] and hook.num_waited == 1 and hook.step_end is None
    hook.step_end = StepEvent(log, 8, done=False)
    hook.launch_scope(SimpleNamespace(is_decode=False, future_rows=None))  # type: ignore[arg-type]
    assert log == ["main-waits-step-7"] and hook.num_beside == 1


def test_a_prefill_never_reuses_a_slot_the_running_step_writes() -> None:
    """A full pool: the late prompt needs slots the finished request held while the next step (which still has it)
    runs. The free that hands them back comes after the main stream's wait for that step."""
    early = make_requests(2, seed=5, max_new_tokens=30, prompt_len=(20, 20))
    early[0].params = SamplingParams(max_new_tokens=4, temperature=0.0)
    late = make_requests(1, seed=6, max_new_tokens=4, prompt_len=(40, 40))
    sched, col, _, log = _hooked_scheduler(max_total_tokens=96, disable_radix_cache=True)
    _staggered(sched, early, late, late_at=4)
    assert len(col.finish) == 3 and not col.errors
    waits = [i for i, e in enumerate(log) if e.startswith("main-waits")]
    assert waits and log[waits[0] + 1] == "free-slots"
    assert_no_leak(sched)


@pytest.mark.parametrize(("overrides", "runner", "reason"), [
    ({}, {}, None),
    ({"disable_decode_stream": True}, {}, "--disable-decode-stream"),
    ({"overlap_schedule": "off"}, {}, "no overlap on a CUDA device"),
    ({}, {"graph_runner": None}, "no decode CUDA graphs"),
    ({}, {"attn_backend": SimpleNamespace()}, "backend shares state"),
    ({}, {"model": SimpleNamespace(rows_independent=False)}, "MoE"),
    ({}, {"lora": object()}, "LoRA"),
    ({"speculative_algorithm": "ngram"}, {}, "speculative decoding"),
    ({"enable_hierarchical_cache": True}, {}, "host tier"),
])
def test_where_decode_steps_get_their_own_stream(overrides: dict[str, Any], runner: dict[str, Any],
                                                 reason: str | None) -> None:
    config = EngineConfig(**{"device": "cpu", "overlap_schedule": "on", **overrides})
    parts: dict[str, Any] = dict(config=config, device=torch.device("cuda"), graph_runner=object(),
                                 attn_backend=TritonBackend(),
                                 model=SimpleNamespace(rows_independent=True), lora=None, mm=None, dp=None,
                                 tp=SimpleNamespace(enabled=False))
    parts.update(runner)
    sched = SimpleNamespace(config=config, runner=SimpleNamespace(**parts))
    got = decode_stream.refusal(sched)  # type: ignore[arg-type]
    assert (got is None) if reason is None else (got is not None and reason in got), got


def test_a_cpu_scheduler_keeps_one_stream() -> None:
    sched, _ = make_scheduler(overlap_schedule="on")
    assert sched.hooks.get(DecodeStreamHook) is None
    assert "num_prefills_beside_decode" not in sched.stats()


def test_a_prefill_drops_the_pacers_pending_step_times() -> None:
    """A step that a higher-priority prefill ran ahead of is not a decode step's device time."""
    cuda = FakeCuda()
    pacer = LaunchPacer(cuda)
    decode_launch(pacer, cuda, 5.0)
    decode_launch(pacer, cuda, 5.0)  # queued behind the first: would be timed
    pacer.launched(False, 0.001)  # a prefill, 50 ms, ahead of the second step
    cuda.now_ms += 50.0
    cuda.done_ms = cuda.now_ms
    pacer.results_read(is_decode=True)
    assert pacer.step_s is None
    decode_launch(pacer, cuda, 5.0)
    decode_launch(pacer, cuda, 5.0)
    cuda.done_ms = cuda.now_ms
    pacer.results_read(is_decode=True)
    assert pacer.step_s == pytest.approx(0.005)


def test_the_sampling_cache_keeps_decode_infos_through_a_prefill() -> None:
    cache = SamplingInfoCache()
    decode_rows, prefill_rows = [object(), object()], [object()]
    kept = SimpleNamespace(is_step_invariant=True, output_lens=[], vocab_mask=None)
    assert cache.get(decode_rows, [1, 1], lambda: kept) is kept  # type: ignore[arg-type, return-value]
    fresh = SimpleNamespace(is_step_invariant=True, output_lens=[], vocab_mask=None)
    assert cache.get(prefill_rows, [0], lambda: fresh, keep=False) is fresh  # type: ignore[arg-type, return-value]
    assert cache.get(decode_rows, [2, 2], lambda: pytest.fail("rebuilt")) is kept
    assert cache.get(prefill_rows, [0], lambda: fresh, keep=False) is fresh  # type: ignore[arg-type, return-value]
    assert cache.num_builds == 3 and cache.num_reuses == 1


def test_eager_decode_and_eager_short_extends_keep_apart_scratch() -> None:
    backend = TritonBackend()
    layer = SimpleNamespace(num_heads=4, head_dim=8)
    decode = backend._decode_scratch(3, layer, 2, torch.device("cpu"))  # type: ignore[arg-type]
    extend = backend._decode_scratch(3, layer, 2, torch.device("cpu"), extend=True)  # type: ignore[arg-type]
    assert decode is not extend and decode.mid_out.data_ptr() != extend.mid_out.data_ptr()
    assert backend._decode_scratch(2, layer, 2, torch.device("cpu")) is decode  # type: ignore[arg-type]
    assert backend._decode_scratch(2, layer, 2, torch.device("cpu"), extend=True) is extend  # type: ignore[arg-type]
    assert TritonBackend.concurrent_passes


def test_which_stream_goes_first_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixmesh.common.env import stream_priority

    monkeypatch.delenv("RADIXMESH_STREAM_PRIORITY", raising=False)
    assert stream_priority() == "decode"
    monkeypatch.setenv("RADIXMESH_STREAM_PRIORITY", "Main")
    assert stream_priority() == "main"
    monkeypatch.setenv("RADIXMESH_STREAM_PRIORITY", "prefill")
    with pytest.raises(Exception, match="RADIXMESH_STREAM_PRIORITY must be one of decode, equal, main"):
        stream_priority()
