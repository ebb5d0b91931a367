"""The small-batch MoE path compiled on a GPU at the Qwen3-30B-A3B and Mixtral-8x7B shapes: against `moe_ref` and
the sorted path, FP8 experts, expert-parallel halves, and CUDA-graph replays with and without PDL (skipped
without CUDA)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # skipped then; keep the CPU tests' interpreter mode

import pytest

from radixmesh.kernels._pdl import set_pdl
from radixmesh.kernels.moe import MoeWorkspace, fused_moe
from radixmesh.kernels.moe_ref import moe_ref, route_ref
from radixmesh.kernels.moe_routing import RouterSpec

from .test_moe_gpu import DEVICE, MIXTRAL, QWEN3, _fp8, _inputs, _layer, _rel_err

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def qwen3() -> tuple[torch.Tensor, torch.Tensor]:
    return _layer(QWEN3)


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_qwen3_small_path_matches_reference_and_sorted(qwen3: tuple[torch.Tensor, torch.Tensor], m: int) -> None:
    x, logits = _inputs(m, QWEN3)
    small = fused_moe(x, logits, *qwen3, RouterSpec(8), path="small")
    weights, ids = route_ref(logits, 8)
    assert _rel_err(small, moe_ref(x, *qwen3, weights, ids)) < 1e-2
    assert _rel_err(small, fused_moe(x, logits, *qwen3, RouterSpec(8), path="sorted")) < 1e-2
    assert torch.equal(small, fused_moe(x, logits, *qwen3, RouterSpec(8), path="small")), "not deterministic"


@pytest.mark.parametrize("m", [1, 4])
def test_mixtral_small_path_matches_reference(m: int) -> None:
    w13, w2 = _layer(MIXTRAL)
    x, logits = _inputs(m, MIXTRAL)
    got = fused_moe(x, logits, w13, w2, RouterSpec(2), path="small")
    weights, ids = route_ref(logits, 2)
    assert _rel_err(got, moe_ref(x, w13, w2, weights, ids)) < 1e-2


@pytest.mark.parametrize("m", [1, 4])
def test_qwen3_small_path_fp8_experts(qwen3: tuple[torch.Tensor, torch.Tensor], m: int) -> None:
    (q13, s13), (q2, s2) = _fp8(qwen3[0]), _fp8(qwen3[1])
    x, logits = _inputs(m, QWEN3, seed=3)
    got = fused_moe(x, logits, q13, q2, RouterSpec(8), w13_scale=s13, w2_scale=s2, path="small")
    weights, ids = route_ref(logits, 8)
    assert _rel_err(got, moe_ref(x, q13, q2, weights, ids, s13, s2)) < 2e-2


def test_small_path_expert_parallel_halves_sum_to_the_layer(qwen3: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, logits = _inputs(2, QWEN3, seed=7)
    w13, w2 = qwen3
    halves = [fused_moe(x, logits, w13[lo:lo + 64], w2[lo:lo + 64], RouterSpec(8), expert_start=lo,
                        path="small").float() for lo in (0, 64)]
    weights, ids = route_ref(logits, 8)
    assert _rel_err(halves[0] + halves[1], moe_ref(x, w13, w2, weights, ids)) < 1e-2


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("m", [1, 4])
def test_small_path_replays_in_a_cuda_graph(qwen3: tuple[torch.Tensor, torch.Tensor], pdl: bool, m: int) -> None:
    set_pdl(pdl)
    try:
        ws = MoeWorkspace.allocate(8, 8, 128, 128, 2048, 768, torch.bfloat16, DEVICE)
        load = torch.zeros(128, dtype=torch.int64, device=DEVICE)
        x, logits = _inputs(m, QWEN3, seed=4)
        out = torch.empty_like(x)
        fused_moe(x, logits, *qwen3, RouterSpec(8), workspace=ws, out=out, path="small")  # compile outside
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fused_moe(x, logits, *qwen3, RouterSpec(8), workspace=ws, out=out, expert_load=load, path="small")
        for seed in (5, 6):
            new_x, new_logits = _inputs(m, QWEN3, seed=seed)
            x.copy_(new_x)
            logits.copy_(new_logits)
            graph.replay()
            eager = fused_moe(new_x, new_logits, *qwen3, RouterSpec(8), path="small")
            assert torch.equal(out, eager), "a replay differs from the same call made eagerly"
        assert int(load.sum()) == 2 * m * 8
    finally:
        set_pdl(True)
