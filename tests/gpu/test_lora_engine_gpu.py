"""LoRA adapters in the engine on a GPU (skipped without CUDA): a decode batch mixing adapters and the base model
gives the same greedy tokens replayed in CUDA graphs as run eagerly, and as the CPU's matmul path, with adapters
taking turns on fewer slots than adapters; base requests on a LoRA engine give a plain engine's tokens; at batch 1
the fused norm GEMVs with the adapter as an addend match the norm, the GEMV and the adapter's launches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixmesh.engine.bench.lora import write_random_adapters
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.request import Req
from radixmesh.wire.sampling import SamplingParams

from ..unit.scheduler_factory import assert_no_leak, run_until_idle
from ..unit.tp_factory import TINY_SHAPE, close_scheduler, make_tp_scheduler, write_tiny_checkpoint

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 17, 3, 99, 42, 8, 61], [7, 7, 12, 88, 3], list(range(1, 40)), [50] * 20]
GPU_SHAPE = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
"""The tiny shape with heads of 16 (the Triton attention kernels' tl.dot needs K >= 16)."""


def _tiny(tmp_path: Path, num_adapters: int, seed: int) -> tuple[Path, list[Path]]:
    model = write_tiny_checkpoint(tmp_path / "tiny", **GPU_SHAPE)
    config = ModelConfig.from_hf_dict({**TINY_SHAPE, **GPU_SHAPE})
    return model, write_random_adapters(config, tmp_path / "adapters", num_adapters, 16, seed=seed)


def _run(model: Path, adapters: list[Path], slots: int, **overrides: object) -> dict[str, list[int]]:
    sched, col = make_tp_scheduler(model, 1, lora_paths=tuple(f"a{i}={p}" for i, p in enumerate(adapters)),
                                   max_lora_rank=16, max_loras_per_batch=slots, **overrides)
    try:
        names: list[str | None] = [None, *[f"a{i}" for i in range(len(adapters))]]
        for i, prompt in enumerate(PROMPTS * 2):
            sched.add_request(Req(rid=f"r{i}", origin_input_ids=list(prompt), lora_name=names[i % len(names)],
                                  params=SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)))
        run_until_idle(sched)
        assert not col.errors, col.errors
        assert_no_leak(sched)
        return col.tokens
    finally:
        close_scheduler(sched)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("slots,kernels", [(3, "auto"), (2, "auto"), (3, "rows"), (3, "grouped")])
def test_graphs_match_eager_and_cpu(tmp_path: Path, slots: int, kernels: str) -> None:
    model, adapters = _tiny(tmp_path, 3, seed=5)
    cpu = _run(model, adapters, slots)
    gpu = dict(device="cuda", dtype="float32", disable_gemv=True, lora_kernels=kernels)
    graphs = _run(model, adapters, slots, **gpu)
    eager = _run(model, adapters, slots, disable_cuda_graph=True, **gpu)
    assert graphs == eager == cpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernels", ["epilogue", "auto", "rows"])
def test_batch_one_with_the_gemv_matches_eager_and_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       kernels: str) -> None:
    """One request at a time (every decode step of one row) in float32 with the batch-1 GEMVs and their fused
    norms on: the adapter in the GEMVs' epilogues (epilogue, auto) or in its own launches (rows) gives the CPU's
    greedy tokens, in CUDA graphs and eagerly."""
    from radixmesh.engine import runner_build

    monkeypatch.setattr(runner_build, "GEMV_DTYPES", (*runner_build.GEMV_DTYPES, torch.float32))
    model, adapters = _tiny(tmp_path, 2, seed=7)
    from radixmesh.engine.lora.layers import LoraProjection

    shrinks = []
    epilogue = LoraProjection.epilogue
    monkeypatch.setattr(LoraProjection, "epilogue", lambda self, *a: shrinks.append(1) or epilogue(self, *a))
    cpu = _run(model, adapters, 2, max_running_requests=1)
    gpu = dict(device="cuda", dtype="float32", lora_kernels=kernels, max_running_requests=1)
    graphs = _run(model, adapters, 2, **gpu)
    shrinks.clear()
    eager = _run(model, adapters, 2, disable_cuda_graph=True, **gpu)
    assert graphs == eager == cpu
    assert (len(shrinks) > 0) == (kernels != "rows"), f"{len(shrinks)} epilogue shrinks under {kernels}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_base_requests_replay_the_graphs_without_lora_launches(tmp_path: Path) -> None:
    """A LoRA engine serving only base requests (bf16, the GEMV and its fused prologues on) gives the tokens of an
    engine without LoRA, through the graphs captured without the adapters' launches."""
    model, adapters = _tiny(tmp_path, 2, seed=6)
    tokens = []
    for lora in (False, True):
        sched, col = make_tp_scheduler(model, 1, device="cuda", dtype="bfloat16",
                                       **({"lora_paths": (f"a0={adapters[0]}",), "max_lora_rank": 16} if lora else {}))
        try:
            for i, prompt in enumerate(PROMPTS):
                sched.add_request(Req(rid=f"r{i}", origin_input_ids=list(prompt),
                                      params=SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)))
            run_until_idle(sched)
            assert not col.errors, col.errors
            graphs = sched.runner.graph_runner
            assert graphs is not None and graphs.num_replays > 0
            assert graphs.variants == ((False, True) if lora else (False,))
            tokens.append(col.tokens)
        finally:
            close_scheduler(sched)
    assert tokens[0] == tokens[1]


def _lora_layer(k: int, n: int, slices: tuple[int, ...], kernels: str, slot: int) -> tuple[Any, Any]:
    """A bf16 Linear `[n, k]` with the GEMV and its prologues on and a LoRA projection of 3 slots of rank <= 16
    (the batch: one row of `slot`)."""
    from radixmesh.engine.lora.layers import LoraBatchState, LoraProjection
    from radixmesh.engine.models.layers import Linear, RMSNorm
    from radixmesh.kernels.lora import LoraBatch

    gen = torch.Generator(device="cuda").manual_seed(n)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    layer = Linear(k, n, bias=False).to(dev, bf16)
    layer.use_gemv = layer.fuse_prologues = True
    ranks = torch.tensor([16, 8, 0], dtype=torch.int32, device=dev)
    scalings = torch.tensor([2.0, 0.5, 1.0], device=dev)
    state = LoraBatchState(ranks, scalings, ranks.tolist(), scalings.tolist(), active=True,
                           kernel_batch=LoraBatch.per_row(torch.tensor([slot], dtype=torch.int32, device=dev)),
                           kernels=kernels)
    a = torch.randn(3, len(slices) * 16, k, device=dev, generator=gen, dtype=bf16) / k**0.5
    b = torch.randn(3, n, 16, device=dev, generator=gen, dtype=bf16) * 0.1
    layer.lora = LoraProjection(state, a, b, slices)
    norm = RMSNorm(k, 1e-5).to(dev, bf16)
    norm.weight.data = 1 + 0.1 * torch.randn(k, device=dev, generator=gen, dtype=bf16)
    return layer, norm


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("slot", [0, 1])
def test_batch_one_fused_norm_gemv_takes_the_adapter_as_an_addend(gated: bool, slot: int) -> None:
    from radixmesh.engine.models.layers import SILU_AND_MUL, AddRMSNorm

    k, n = 512, 768
    slices = (n // 2, n // 2) if gated else (512, 128, 128)
    layer, norm = _lora_layer(k, n, slices, "fused", slot)
    x, residual = (torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    prologue = AddRMSNorm(norm, residual)
    assert layer.lora.fuses_prologue(x)
    fused = prologue.fused_gemv(layer, x, gated=gated) if gated else prologue.fused_gemv(layer, x)
    assert fused is not None, "the fused GEMV runs with the adapter"
    layer.lora.state.kernels = "rows"  # the unfused path: norm, GEMV, the adapter's launches (and SiLU-and-mul)
    assert not layer.lora.fuses_prologue(x) and AddRMSNorm(norm, residual).fused_gemv(layer, x) is None
    unfused = layer(x, AddRMSNorm(norm, residual))
    if gated:
        unfused = SILU_AND_MUL.apply(unfused)
    plain = layer._project(AddRMSNorm(norm, residual).apply(x))  # no adapter
    if gated:
        plain = SILU_AND_MUL.apply(plain)
    err = float((fused.float() - unfused.float()).norm() / (unfused.float() - plain.float()).norm())
    assert err < 0.05, f"fused vs unfused differ by {err:.3g} of the adapter's contribution"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["plain", "norm", "gated"])
@pytest.mark.parametrize("slot", [0, 1, 2])
def test_batch_one_gemv_epilogue_matches_the_adapters_own_launches(kind: str, slot: int) -> None:
    """bf16, one row: the adapter in the GEMV's epilogue (plain GEMV; fused norm GEMV; gated) against the unfused
    path (norm, GEMV, the per-row shrink and expand, SiLU-and-mul); slot 2 is empty (rank 0)."""
    from radixmesh.engine.models.layers import SILU_AND_MUL, AddRMSNorm

    k, n = 512, 768
    slices = (n // 2, n // 2) if kind == "gated" else (512, 128, 128)
    layer, norm = _lora_layer(k, n, slices, "epilogue", slot)
    x, residual = (torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def run(kernels: str) -> torch.Tensor:
        layer.lora.state.kernels = kernels
        if kind == "plain":
            return layer(x)
        if kind == "gated":
            fused = AddRMSNorm(norm, residual).fused_gemv(layer, x, gated=True)
            return fused if fused is not None else SILU_AND_MUL.apply(layer(x, AddRMSNorm(norm, residual)))
        return layer(x, AddRMSNorm(norm, residual))

    assert layer.lora.takes_epilogue(x) and layer.lora.fuses_prologue(x)
    got = run("epilogue")
    want = run("rows")
    layer.lora.state.active = False
    plain = run("rows")
    layer.lora.state.active = True
    scale = (want.float() - plain.float()).norm()
    if slot == 2:
        assert torch.equal(got, plain), "an empty slot adds nothing"
        return
    err = float((got.float() - want.float()).norm() / scale)
    assert err < 0.05, f"epilogue vs the adapter's own launches differ by {err:.3g} of its contribution"
