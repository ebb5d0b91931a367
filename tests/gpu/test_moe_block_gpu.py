"""The one-launch MoE block compiled on a GPU at the Qwen3-30B-A3B shape: against the four launches it replaces
(`gemv_add_rmsnorm_out`, `small_topk`, `small_gate_up`, `small_down` with the same tiles) for 1, 2 and 4 programs
per SM with PDL on and off, 200 launches in a row, and a CUDA graph of chained blocks replayed 50 times (skipped
without CUDA). Every check also asserts that no grid barrier timed out and that the counters are back at 0."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # skipped then; keep the CPU tests' interpreter mode

from dataclasses import replace

import pytest

from radixmesh.kernels._pdl import set_pdl
from radixmesh.kernels.gemv_norm_out import gemv_add_rmsnorm_out
from radixmesh.kernels.moe_block import MoeBlockWorkspace, moe_block_decode, moe_block_supported
from radixmesh.kernels.moe_config import MoeBlockConfig, SmallTiles, block_default_config
from radixmesh.kernels.moe_ref import moe_ref, route_ref
from radixmesh.kernels.moe_routing import RouterSpec
from radixmesh.kernels.moe_small import small_down, small_gate_up, small_topk

from ..unit.test_moe_block import EPS, Block
from .test_moe_gpu import DEVICE, QWEN3, _layer, _rel_err

pytestmark = pytest.mark.gpu

EXPERTS, HIDDEN, INTER, TOP_K = QWEN3
SPEC = RouterSpec(TOP_K)
DEFAULT = block_default_config(EXPERTS, INTER, HIDDEN, TOP_K, DEVICE)


@pytest.fixture(scope="module")
def qwen3() -> Block:
    w13, w2 = _layer(QWEN3)
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    router = torch.randn(EXPERTS, HIDDEN, device=DEVICE, generator=gen, dtype=torch.bfloat16) * 0.02
    norm = (1 + 0.1 * torch.randn(HIDDEN, device=DEVICE, generator=gen)).to(torch.bfloat16)
    x, residual = _rows(seed=1)
    return Block(x, residual, norm, router, w13, w2)


def _rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(1, HIDDEN, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    return x, torch.randn(1, HIDDEN, device=DEVICE, generator=gen, dtype=torch.bfloat16)


def _workspace() -> MoeBlockWorkspace:
    return MoeBlockWorkspace.allocate(EXPERTS, TOP_K, INTER, HIDDEN, torch.bfloat16, DEVICE)


def _run(b: Block, ws: MoeBlockWorkspace, config: MoeBlockConfig = DEFAULT, **kw: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return moe_block_decode(b.x, b.residual, b.norm_weight, EPS, b.router, b.w13, b.w2, SPEC, ws, config=config, **kw)


def _check_synced(ws: MoeBlockWorkspace) -> None:
    torch.cuda.synchronize()
    assert not ws.timed_out(), "a grid barrier timed out: the programs were not all resident"
    assert ws.sync[:2].tolist() == [0, 0], f"counters not reset: {ws.sync.tolist()}"


def _small_path(ws: MoeBlockWorkspace, h: torch.Tensor, b: Block, cfg: MoeBlockConfig
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(inter, out)` of `small_gate_up` + `small_down` with the block's tiles, on the block's own top-k."""
    up = SmallTiles(cfg.block_i, cfg.up_block_k, cfg.num_warps, cfg.up_stages)
    down = SmallTiles(cfg.block_h, cfg.down_block_k, cfg.num_warps, cfg.down_stages)
    inter = small_gate_up(h, ws.topk_ids, b.w13, up, torch.empty_like(ws.inter))
    return inter, small_down(inter, ws.topk_ids, ws.topk_weights, b.w2, down, torch.empty_like(h))


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("ctas_per_sm", [1, 2, 4])
def test_block_matches_the_unfused_chain(qwen3: Block, ctas_per_sm: int, pdl: bool) -> None:
    assert moe_block_supported(qwen3.x, qwen3.router, qwen3.w13, qwen3.w2, SPEC)
    set_pdl(pdl)
    try:
        ws, load = _workspace(), torch.zeros(EXPERTS, dtype=torch.int64, device=DEVICE)
        out, h, summed = _run(qwen3, ws, replace(DEFAULT, ctas_per_sm=ctas_per_sm), expert_load=load)
        _check_synced(ws)
        logits, want_h, want_summed = gemv_add_rmsnorm_out(qwen3.x, qwen3.residual, qwen3.norm_weight, EPS,
                                                           qwen3.router)
    finally:
        set_pdl(True)
    assert torch.equal(summed, want_summed)
    assert torch.equal(h, want_h), f"h differs from gemv_add_rmsnorm_out's by {(h - want_h).abs().max()}"
    torch.testing.assert_close(ws.logits, logits, rtol=2 ** -7, atol=2e-3)  # the same sums, another order
    ids, weights = torch.empty_like(ws.topk_ids), torch.empty_like(ws.topk_weights)
    small_topk(ws.logits, SPEC, ids, weights)
    assert torch.equal(ids, ws.topk_ids)
    torch.testing.assert_close(weights, ws.topk_weights, rtol=1e-6, atol=0)
    assert load.tolist() == torch.bincount(ids.view(-1).long().cpu(), minlength=EXPERTS).tolist()
    inter, small_out = _small_path(ws, h, qwen3, DEFAULT)
    assert _rel_err(ws.inter, inter) < 1e-2 and _rel_err(out, small_out) < 1e-2
    ref_w, ref_ids = route_ref(ws.logits, TOP_K)
    assert _rel_err(out, moe_ref(h, qwen3.w13, qwen3.w2, ref_w, ref_ids)) < 1e-2


def test_block_gives_the_small_paths_bits_for_any_grid(qwen3: Block) -> None:
    """Each unit's sums do not depend on which program runs it: every grid size gives the same bits, and with the
    small path's tiles (and reduction layouts) the small path's."""
    ws = _workspace()
    outs = [_run(qwen3, ws, replace(DEFAULT, ctas_per_sm=c))[0] for c in (1, 2, 4, 32)]  # 32: lowered to what fits
    _check_synced(ws)
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), "the output depends on the grid size"
    inter, small_out = _small_path(ws, _run(qwen3, ws)[1], qwen3, DEFAULT)
    assert torch.equal(ws.inter, inter), f"inter differs from small_gate_up's by {(ws.inter - inter).abs().max()}"
    assert torch.equal(outs[0], small_out), f"out differs from small_down's by {(outs[0] - small_out).abs().max()}"


def test_200_launches_in_a_row(qwen3: Block) -> None:
    ws, load = _workspace(), torch.zeros(EXPERTS, dtype=torch.int64, device=DEVICE)
    other = qwen3._replace(**dict(zip(("x", "residual"), _rows(seed=2))))
    blocks = (qwen3, other)
    outs = [_run(blocks[i % 2], ws, expert_load=load)[0].clone() for i in range(200)]
    _check_synced(ws)
    assert not torch.equal(outs[0], outs[1])
    for i, out in enumerate(outs):
        assert torch.equal(out, outs[i % 2]), f"launch {i} differs from launch {i % 2}"
    assert int(load.sum()) == 200 * TOP_K


@pytest.mark.parametrize("pdl", [True, False])
def test_chained_blocks_replay_in_a_cuda_graph(qwen3: Block, pdl: bool) -> None:
    """Three blocks sharing one workspace, each fed the one before it (as layers are), captured once and replayed
    50 times over five inputs: each replay equals the same chain run eagerly."""
    set_pdl(pdl)
    try:
        ws = _workspace()
        x, residual = qwen3.x.clone(), qwen3.residual.clone()

        def chain() -> torch.Tensor:
            h_in, res = x, residual
            for _ in range(3):
                out, _, res = moe_block_decode(h_in, res, qwen3.norm_weight, EPS, qwen3.router, qwen3.w13, qwen3.w2,
                                               SPEC, ws)
                h_in = out
            return out

        inputs = [_rows(seed=10 + i) for i in range(5)]
        eager = []
        for new_x, new_res in inputs:
            x.copy_(new_x)
            residual.copy_(new_res)
            eager.append(chain().clone())
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed = chain()
        for i in range(50):
            x.copy_(inputs[i % 5][0])
            residual.copy_(inputs[i % 5][1])
            graph.replay()
            assert torch.equal(graphed, eager[i % 5]), f"replay {i} differs from the eager chain"
        _check_synced(ws)
    finally:
        set_pdl(True)
