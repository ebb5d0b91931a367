"""Prefills beside the running decode step on a real GPU (scheduler/decode_stream.py): decode steps on a CUDA stream
of their own, prefills on the main stream, launched while steps run. The tokens equal those of the same launches on
one stream, nothing syncs behind the host's back, no slot or row leaks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.decode_stream import DecodeStreamHook
from radixmesh.wire.sampling import SamplingParams

from ..unit.scheduler_factory import assert_no_leak, clone, make_requests, make_scheduler, tiny_model_config
from .test_hot_path_gpu import GPU_ENGINE, SyncMonitor

pytestmark = pytest.mark.gpu
SLEEP_CYCLES = 4_000_000
"""A spin kernel of this many clock cycles (~2 ms) on the decode stream ahead of each step: a tiny model's step ends
before the host schedules the next batch, so without it no prefill would meet a running step."""

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


def _model() -> Any:
    # wider than the hot-path model: decode steps and prefills that take the device for a while
    return tiny_model_config(hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2,
                             head_dim=64, max_position_embeddings=2048, eos_token_ids=())


def _traffic() -> tuple[list[Req], dict[int, list[Req]]]:
    """Four requests decoding from the start (two finish early), then prompts of 9-700 tokens arriving every few
    steps, a shared prefix among some, while the others decode and finish."""
    early = make_requests(4, seed=11, max_new_tokens=60, prompt_len=(20, 200))
    early[1].params = SamplingParams(max_new_tokens=7, temperature=0.0)
    early[2].params = SamplingParams(max_new_tokens=19, temperature=0.0)
    arrivals: dict[int, list[Req]] = {}
    for step, (n, lens, new) in enumerate([(1, (9, 9), 12), (2, (300, 700), 20), (1, (40, 60), 5),
                                           (3, (100, 400), 30), (1, (600, 700), 8)]):
        arrivals[6 + 9 * step] = make_requests(n, seed=20 + step, shared_prefix_len=32 if n > 1 else 0,
                                               max_new_tokens=new, prompt_len=lens)
    return early, arrivals


def _run(sched: Any, early: list[Req], arrivals: dict[int, list[Req]]) -> None:
    for req in early:
        sched.add_request(clone(req))
    steps = 0
    last = max(arrivals, default=-1)
    while sched.has_work or steps <= last:
        for req in arrivals.get(steps, []):
            sched.add_request(clone(req))
        sched.step()
        steps += 1
        assert steps < 3000, "the scheduler did not finish"


def test_prefills_beside_decode_steps_give_the_one_stream_tokens() -> None:
    early, arrivals = _traffic()
    warm = make_requests(4, seed=99, max_new_tokens=6, prompt_len=(5, 300))

    base, base_col = make_scheduler(_model(), **GPU_ENGINE, disable_decode_stream=True, max_total_tokens=20000)
    assert base.hooks.get(DecodeStreamHook) is None
    _run(base, warm, {})
    _run(base, early, arrivals)
    torch.cuda.synchronize()

    sched, col = make_scheduler(_model(), **GPU_ENGINE, max_total_tokens=20000)
    hook = sched.hooks.get(DecodeStreamHook)
    assert hook is not None, "decode steps did not get their own stream"
    streams: Any = hook.streams
    assert torch.cuda.current_stream() == streams.main
    assert streams.decode.priority < streams.main.priority  # the default: the step first (lower is higher)
    _run(sched, warm, {})  # Triton compiles and the pinned pools fill outside the monitored block
    enter = streams.enter_decode

    def late_enter() -> None:  # each step's kernels start ~2 ms late: what `main` queues meanwhile runs first
        enter()
        torch.cuda._sleep(SLEEP_CYCLES)

    streams.enter_decode = late_enter
    with SyncMonitor() as monitor:
        _run(sched, early, arrivals)
    assert monitor.syncs == [], monitor.report()
    torch.cuda.synchronize()
    assert_no_leak(sched)
    assert hook.num_beside >= 3, f"only {hook.num_beside} prefills were launched while a decode step ran"
    assert hook.num_release_waits >= 1
    for rid, tokens in base_col.tokens.items():
        assert col.tokens.get(rid) == tokens, rid
    assert len(col.finish) == len(base_col.finish) == 4 + sum(len(v) for v in arrivals.values()) + len(warm)
