"""The LoRA shrink on a side stream beside the base GEMM (--lora-overlap) on a GPU (skipped without CUDA): two
chained projections give the same bits with it on and off, eagerly and replayed from a CUDA graph captured with it
on; an engine decoding a batch of 8 over several adapters gives the same greedy tokens with it on (graphs and
eager), off and auto, and takes the side stream where the setting says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixmesh.engine.request import Req
from radixmesh.wire.sampling import SamplingParams

from ..unit.scheduler_factory import assert_no_leak, run_until_idle
from ..unit.tp_factory import close_scheduler, make_tp_scheduler
from .test_lora_engine_gpu import PROMPTS, _tiny

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROWS = 32
SLOTS = [16, 8, 16, 0]  # ranks; slot 3 is empty


def _layers(overlap: str) -> tuple[Any, Any, Any]:
    """Two bf16 projections with LoRA slots sharing one batch state (q/k/v-like 512 -> 768 with three slices, then
    o-like 768 -> 512), rows spread over the slots and the base model; and the state."""
    from radixmesh.engine.lora.layers import LoraBatchState, LoraProjection
    from radixmesh.engine.models.layers import Linear
    from radixmesh.kernels.lora import LoraBatch

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    ranks = torch.tensor(SLOTS, dtype=torch.int32, device=dev)
    scalings = torch.tensor([2.0, 0.5, 1.0, 1.0], device=dev)
    slots = torch.tensor([i % 5 - 1 for i in range(ROWS)], dtype=torch.int32, device=dev)  # -1: the base model
    state = LoraBatchState(ranks, scalings, ranks.tolist(), scalings.tolist(), active=True,
                           kernel_batch=LoraBatch.per_row(slots), kernels="rows", overlap=overlap)
    layers = []
    for k, slices in ((512, (512, 128, 128)), (768, (512,))):
        n = sum(slices)
        layer = Linear(k, n, bias=False).to(dev, bf16)
        a = torch.randn(len(SLOTS), len(slices) * 16, k, device=dev, generator=gen, dtype=bf16) / k**0.5
        b = torch.randn(len(SLOTS), n, 16, device=dev, generator=gen, dtype=bf16) * 0.1
        layer.lora = LoraProjection(state, a, b, slices)
        layers.append(layer)
    return layers[0], layers[1], state


def _adapter_err(got: torch.Tensor, want: torch.Tensor, base: torch.Tensor) -> float:
    """|got - want| relative to the adapters' own share of `want`."""
    return float((got.float() - want.float()).norm() / (want.float() - base.float()).norm())


@pytest.mark.parametrize("mode", ["on", "side"])
def test_chained_projections_give_the_same_bits_with_the_overlap_eagerly_and_in_a_graph(mode: str) -> None:
    """"on": the same bits as without the overlap; "side" (the adapters' sum rounded to bf16 before its add): within
    the rounding of that sum, and a graph replays what eager runs give."""
    first, second, state = _layers("off")
    x = torch.randn(ROWS, 512, device="cuda", dtype=torch.bfloat16)
    assert first.lora.overlap_kind(x) is None
    want = second(first(x))
    state.active = False
    base = second(first(x))
    state.active, state.overlap = True, mode
    assert first.lora.overlap_kind(x) == "rows"
    assert not torch.equal(want, base), "the adapters change the output"
    if mode == "on":
        assert torch.equal(second(first(x)), want), "eager, overlap on vs off"
    else:
        assert _adapter_err(second(first(x)), want, base) < 0.05, "eager, expand on the side vs off"

    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        second(first(static_x))  # warm up on the capture stream
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            out = second(first(static_x))
    for seed in (1, 2):
        fresh = torch.randn(ROWS, 512, device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator(device="cuda").manual_seed(seed))
        static_x.copy_(fresh)
        state.kernel_batch.slots.copy_(state.kernel_batch.slots.roll(seed))
        graph.replay()
        state.overlap = "off" if mode == "on" else mode
        eager = second(first(fresh))
        state.overlap = mode
        state.active = False
        plain = second(first(fresh))
        state.active = True
        torch.cuda.synchronize()
        # a shrink the expand did not wait for would leave the last replay's xa: an error of the adapters' size
        err = _adapter_err(out, eager, plain)
        assert err < 1e-3, f"replay {seed}: graph with the overlap ({mode}) vs eager differ by {err:.3g}"


def _run(model: Path, adapters: list[Path], monkeypatch: pytest.MonkeyPatch, **overrides: object
         ) -> tuple[dict[str, list[int]], int]:
    """Greedy tokens of 8 requests decoded together (base, then each adapter in turn), and how many projections took
    the side stream (a graph counts its capture)."""
    from radixmesh.kernels import lora_overlap

    calls = []
    overlapped = lora_overlap.lora_overlapped  # each run patches it anew (monkeypatch restores it at the end)
    monkeypatch.setattr(lora_overlap, "lora_overlapped", lambda *a, **k: calls.append(1) or overlapped(*a, **k))
    sched, col = make_tp_scheduler(model, 1, lora_paths=tuple(f"a{i}={p}" for i, p in enumerate(adapters)),
                                   max_lora_rank=16, max_loras_per_batch=len(adapters), device="cuda",
                                   dtype="float32", disable_gemv=True, **overrides)
    try:
        names: list[str | None] = [None, *[f"a{i}" for i in range(len(adapters))]]
        for i, prompt in enumerate(PROMPTS * 2):  # 8 requests, admitted together
            sched.add_request(Req(rid=f"r{i}", origin_input_ids=list(prompt), lora_name=names[i % len(names)],
                                  params=SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)))
        run_until_idle(sched)
        assert not col.errors, col.errors
        assert_no_leak(sched)
        return col.tokens, len(calls)
    finally:
        close_scheduler(sched)


def test_decode_tokens_with_the_overlap_match_without_it_in_graphs_and_eagerly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, adapters = _tiny(tmp_path, 3, seed=9)
    off, off_calls = _run(model, adapters, monkeypatch, lora_overlap="off")
    on, on_calls = _run(model, adapters, monkeypatch, lora_overlap="on")
    on_eager, eager_calls = _run(model, adapters, monkeypatch, lora_overlap="on", disable_cuda_graph=True)
    auto, auto_calls = _run(model, adapters, monkeypatch, lora_overlap="auto")
    side, side_calls = _run(model, adapters, monkeypatch, lora_overlap="side")
    assert len(off) == len(PROMPTS) * 2
    assert on == off == on_eager == auto == side and side_calls > 0
    assert off_calls == 0 and on_calls > 0 and eager_calls > 0 and auto_calls > 0, (
        off_calls, on_calls, eager_calls, auto_calls)
