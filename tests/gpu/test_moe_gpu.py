"""The MoE kernels compiled on a GPU at the Qwen3-30B-A3B and Mixtral-8x7B shapes: against `moe_ref`, in
CUDA graphs, with and without PDL (skipped without CUDA)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # skipped then; keep the CPU tests' interpreter mode

import pytest

from radixmesh.kernels._pdl import set_pdl
from radixmesh.kernels.fp8_quant import quantize_rows
from radixmesh.kernels.moe import MoeWorkspace, fused_moe
from radixmesh.kernels.moe_config import MoeConfig
from radixmesh.kernels.moe_ref import moe_ref, route_ref
from radixmesh.kernels.moe_routing import RouterSpec, route_align

from ..unit.test_moe_kernels import OTHER_TILES, check_alignment

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
QWEN3 = (128, 2048, 768, 8)  # experts, hidden, moe intermediate, top-k
MIXTRAL = (8, 4096, 14336, 2)


def _layer(shape: tuple[int, int, int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    experts, hidden, inter, _ = shape
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, device=DEVICE, generator=gen, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=DEVICE, generator=gen, dtype=torch.bfloat16) * 0.02
    return w13, w2


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize_rows(w.view(-1, w.shape[2]))
    return q.view(w.shape), s.view(w.shape[:2])


def _inputs(m: int, shape: tuple[int, int, int, int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(m, shape[1], device=DEVICE, generator=gen, dtype=torch.bfloat16),
            torch.randn(m, shape[0], device=DEVICE, generator=gen))


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.fixture(scope="module")
def qwen3() -> tuple[torch.Tensor, torch.Tensor]:
    return _layer(QWEN3)


@pytest.mark.parametrize("experts,top_k,m", [(8, 2, 1), (128, 8, 33), (128, 8, 2048), (256, 8, 300)])
def test_routing_at_real_widths(experts: int, top_k: int, m: int) -> None:
    logits = torch.randn(m, experts, device=DEVICE)
    for block_m in (1, 16, 64):
        al = route_align(logits, RouterSpec(top_k), block_m)
        weights, ids = route_ref(logits, top_k)
        assert torch.equal(al.topk_ids, ids)
        torch.testing.assert_close(al.topk_weights, weights, rtol=1e-5, atol=1e-6)
        check_alignment(al, ids)


@pytest.mark.parametrize("m", [1, 8, 64, 256, 4096])
def test_qwen3_layer_matches_reference(qwen3: tuple[torch.Tensor, torch.Tensor], m: int) -> None:
    x, logits = _inputs(m, QWEN3)
    got = fused_moe(x, logits, *qwen3, RouterSpec(8))
    weights, ids = route_ref(logits, 8)
    assert _rel_err(got, moe_ref(x, *qwen3, weights, ids)) < 1e-2


@pytest.mark.parametrize("config", OTHER_TILES)
def test_qwen3_layer_with_other_tiles(qwen3: tuple[torch.Tensor, torch.Tensor], config: MoeConfig) -> None:
    x, logits = _inputs(48, QWEN3, seed=2)
    got = fused_moe(x, logits, *qwen3, RouterSpec(8), config=config)
    weights, ids = route_ref(logits, 8)
    assert _rel_err(got, moe_ref(x, *qwen3, weights, ids)) < 1e-2


@pytest.mark.parametrize("m,fp8_activations", [(4, False), (4, True), (200, False), (200, True)])
def test_qwen3_fp8_experts(qwen3: tuple[torch.Tensor, torch.Tensor], m: int, fp8_activations: bool) -> None:
    (q13, s13), (q2, s2) = _fp8(qwen3[0]), _fp8(qwen3[1])
    x, logits = _inputs(m, QWEN3, seed=3)
    got = fused_moe(x, logits, q13, q2, RouterSpec(8), w13_scale=s13, w2_scale=s2, fp8_activations=fp8_activations)
    weights, ids = route_ref(logits, 8)
    assert _rel_err(got, moe_ref(x, q13, q2, weights, ids, s13, s2, fp8_activations)) < 2e-2
    bf16 = moe_ref(x, *qwen3, weights, ids)  # and near the unquantized layer
    assert _rel_err(got, bf16) < 0.1


@pytest.mark.parametrize("m", [1, 64])
def test_mixtral_layer_matches_reference(m: int) -> None:
    w13, w2 = _layer(MIXTRAL)
    x, logits = _inputs(m, MIXTRAL)
    got = fused_moe(x, logits, w13, w2, RouterSpec(2))
    weights, ids = route_ref(logits, 2)
    assert _rel_err(got, moe_ref(x, w13, w2, weights, ids)) < 1e-2


@pytest.mark.parametrize("pdl", [True, False])
def test_decode_layer_replays_in_a_cuda_graph(qwen3: tuple[torch.Tensor, torch.Tensor], pdl: bool) -> None:
    set_pdl(pdl)
    try:
        ws = MoeWorkspace.allocate(8, 8, 128, 128, 2048, 768, torch.bfloat16, DEVICE)
        x, logits = _inputs(8, QWEN3, seed=4)
        out = torch.empty_like(x)
        fused_moe(x, logits, *qwen3, RouterSpec(8), workspace=ws, out=out)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fused_moe(x, logits, *qwen3, RouterSpec(8), workspace=ws, out=out)
        for seed in (5, 6):
            new_x, new_logits = _inputs(8, QWEN3, seed=seed)
            x.copy_(new_x)
            logits.copy_(new_logits)
            graph.replay()
            eager = fused_moe(new_x, new_logits, *qwen3, RouterSpec(8))
            assert torch.equal(out, eager), "a replay differs from the same call made eagerly"
    finally:
        set_pdl(True)


def test_expert_parallel_halves_sum_to_the_layer(qwen3: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, logits = _inputs(16, QWEN3, seed=7)
    w13, w2 = qwen3
    halves = [fused_moe(x, logits, w13[lo:lo + 64], w2[lo:lo + 64], RouterSpec(8), expert_start=lo).float()
              for lo in (0, 64)]
    weights, ids = route_ref(logits, 8)
    assert _rel_err(halves[0] + halves[1], moe_ref(x, w13, w2, weights, ids)) < 1e-2
