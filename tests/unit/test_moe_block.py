"""The one-launch MoE block of one token (`moe_block`) against the unfused chain it replaces (`gemv_add_rmsnorm_out`,
then `small_topk`, `small_gate_up`, `small_down` with the same tiles) and `moe_ref`, at tiny shapes (under the
Triton interpreter without CUDA: one program, so every grid barrier passes at once)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

from typing import NamedTuple

import pytest

from radixmesh.kernels._occupancy import HOPPER_SM, fitting_ctas
from radixmesh.kernels.gemv_norm_out import gemv_add_rmsnorm_out
from radixmesh.kernels.moe_block import MoeBlockWorkspace, moe_block_decode, moe_block_supported
from radixmesh.kernels.moe_config import MoeBlockConfig, SmallTiles, block_default_config
from radixmesh.kernels.moe_ref import moe_ref, route_ref
from radixmesh.kernels.moe_routing import RouterSpec
from radixmesh.kernels.moe_small import small_down, small_gate_up, small_topk

from .test_moe_kernels import DEVICE, _experts, _rand, _rel_err

EPS = 1e-6
TAILS = MoeBlockConfig(8, 32, 8, 16, num_warps=1, up_stages=1, down_stages=1, ctas_per_sm=1)
"""At H = 80, I = 36: a ragged last K tile in both phases and a ragged last intermediate tile."""


class Block(NamedTuple):
    x: torch.Tensor
    residual: torch.Tensor
    norm_weight: torch.Tensor
    router: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor


def make_block(experts: int, hidden: int, inter: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Block:
    w13, w2 = _experts(experts, hidden, inter, dtype, seed=seed + 5)
    tensors = (_rand(1, hidden, seed=seed).to(dtype), _rand(1, hidden, seed=seed + 1).to(dtype),
               (1 + _rand(hidden, seed=seed + 2, scale=0.1)).to(dtype),
               _rand(experts, hidden, seed=seed + 3, scale=0.3).to(dtype), w13, w2)
    return Block(*(t.to(DEVICE) for t in tensors))


def run_block(b: Block, spec: RouterSpec, ws: MoeBlockWorkspace | None = None, config: MoeBlockConfig | None = None,
              expert_load: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    experts, hidden = b.router.shape
    ws = ws or MoeBlockWorkspace.allocate(experts, spec.top_k, b.w2.shape[2], hidden, b.x.dtype, DEVICE)
    return moe_block_decode(b.x, b.residual, b.norm_weight, EPS, b.router, b.w13, b.w2, spec, ws,
                            expert_load=expert_load, config=config)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-equal under the interpreter (the same reductions over the same tiles); compiled, the two kernels'
    reductions may be laid out apart, so an ulp."""
    if DEVICE.type == "cpu":
        assert torch.equal(got, want), f"max difference {(got.float() - want.float()).abs().max()}"
    else:
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-3)


def assert_synced_back(ws: MoeBlockWorkspace) -> None:
    assert ws.sync.tolist() == [0, 0, 0], f"counters not back at 0 or a timed-out wait: {ws.sync.tolist()}"
    assert not ws.timed_out()


@pytest.mark.parametrize("experts,hidden,inter,spec,config", [
    (8, 64, 32, RouterSpec(2), None),
    (16, 64, 48, RouterSpec(4, renormalize=False), None),
    (12, 64, 40, RouterSpec(3, scoring="sigmoid", routed_scaling_factor=2.5), None),
    (16, 80, 36, RouterSpec(4), TAILS),
    (160, 64, 32, RouterSpec(4), TAILS),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_block_equals_the_unfused_chain(experts: int, hidden: int, inter: int, spec: RouterSpec,
                                        config: MoeBlockConfig | None, dtype: torch.dtype) -> None:
    b = make_block(experts, hidden, inter, dtype, seed=experts + inter)
    ws = MoeBlockWorkspace.allocate(experts, spec.top_k, inter, hidden, dtype, DEVICE)
    out, h, summed = run_block(b, spec, ws, config)
    assert_synced_back(ws)

    logits, want_h, want_summed = gemv_add_rmsnorm_out(b.x, b.residual, b.norm_weight, EPS, b.router)
    assert torch.equal(summed, want_summed)
    assert_same(h, want_h)
    assert_same(ws.logits, logits)
    weights, ids = route_ref(ws.logits.cpu(), spec.top_k, spec.scoring, spec.renormalize, spec.routed_scaling_factor)
    assert torch.equal(ws.topk_ids.cpu(), ids)
    torch.testing.assert_close(ws.topk_weights.cpu(), weights, rtol=1e-5, atol=1e-6)
    small_ids = torch.empty_like(ws.topk_ids)
    small_weights = torch.empty_like(ws.topk_weights)
    small_topk(ws.logits, spec, small_ids, small_weights)
    assert torch.equal(small_ids, ws.topk_ids) and torch.equal(small_weights, ws.topk_weights)

    cfg = config or block_default_config(experts, inter, hidden, spec.top_k, DEVICE)
    up = SmallTiles(cfg.block_i, cfg.up_block_k, cfg.num_warps, cfg.up_stages)
    down = SmallTiles(cfg.block_h, cfg.down_block_k, cfg.num_warps, cfg.down_stages)
    inter_want = small_gate_up(h, ws.topk_ids, b.w13, up, torch.empty_like(ws.inter))
    assert_same(ws.inter, inter_want)
    assert_same(out, small_down(ws.inter, ws.topk_ids, ws.topk_weights, b.w2, down, torch.empty_like(out)))
    assert _rel_err(out, moe_ref(h.cpu(), b.w13.cpu(), b.w2.cpu(), weights, ids)) < 3e-2


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_tied_scores_go_to_the_lower_expert_as_the_top_k_launch_sends_them(scoring: str) -> None:
    """Router rows repeated (equal logits, so equal scores) and all-zero rows (many ties at one score): the block
    chooses the slots and order `small_topk` chooses (ties to the lower index)."""
    b = make_block(16, 64, 32, seed=4)
    router = b.router.clone()
    router[9], router[12] = router[2], router[2]  # three experts tied, maybe among the best
    router[5], router[14] = router[0], router[0]
    router[[3, 7, 10, 11]] = 0
    b = b._replace(router=router)
    for spec in (RouterSpec(6, scoring=scoring), RouterSpec(6, scoring=scoring, renormalize=False)):
        ws = MoeBlockWorkspace.allocate(16, 6, 32, 64, b.x.dtype, DEVICE)
        run_block(b, spec, ws)
        assert_synced_back(ws)
        ids, weights = torch.empty_like(ws.topk_ids), torch.empty_like(ws.topk_weights)
        small_topk(ws.logits, spec, ids, weights)
        assert torch.equal(ws.topk_ids, ids) and torch.equal(ws.topk_weights, weights), (ws.topk_ids, ids)
        logits = ws.logits[0].float()
        assert len(set(logits.tolist())) < 16  # (the ties are there)


def test_launches_in_a_row_count_the_expert_load_and_reset_the_counters() -> None:
    spec = RouterSpec(3)
    ws = MoeBlockWorkspace.allocate(12, 3, 32, 64, torch.bfloat16, DEVICE)
    load = torch.full((12,), 7, dtype=torch.int64, device=DEVICE)
    chosen = []
    for seed in (1, 2, 3):
        b = make_block(12, 64, 32, seed=seed)
        out, h, _ = run_block(b, spec, ws, expert_load=load)
        assert_synced_back(ws)
        weights, ids = route_ref(ws.logits.cpu(), 3)
        assert _rel_err(out, moe_ref(h.cpu(), b.w13.cpu(), b.w2.cpu(), weights, ids)) < 3e-2
        chosen.append(ids.view(-1).long())
    assert load.cpu().tolist() == (7 + torch.bincount(torch.cat(chosen), minlength=12)).tolist()


def test_a_wait_that_never_fills_sets_the_error_flag_and_still_resets_the_counters() -> None:
    b = make_block(8, 64, 32)
    ws = MoeBlockWorkspace.allocate(8, 2, 32, 64, torch.bfloat16, DEVICE)
    if DEVICE.type == "cuda":
        pytest.skip("a compiled wait spins SPIN_POLLS times; the interpreter polls once")
    ws.sync[0] = -5  # as if arrivals went missing: the first barrier's count never reaches the grid
    run_block(b, RouterSpec(2), ws)
    assert ws.timed_out()
    assert ws.sync[:2].tolist() == [0, 0]


def test_supported_layers() -> None:
    b = make_block(8, 64, 32)
    spec = RouterSpec(2)
    assert moe_block_supported(b.x, b.router, b.w13, b.w2, spec)
    assert not moe_block_supported(b.x, b.router, b.w13, b.w2, spec, w13_scale=torch.ones(8, 64))
    assert not moe_block_supported(b.x, b.router, b.w13, b.w2, spec, expert_start=4)
    assert not moe_block_supported(b.x, b.router, b.w13[:4], b.w2[:4], spec)  # a rank's share of the experts
    assert not moe_block_supported(torch.cat([b.x, b.x]), b.router, b.w13, b.w2, spec)
    assert moe_block_supported(b.x.float(), b.router.float(), b.w13.float(), b.w2.float(), spec)  # (CPU tests)
    assert not moe_block_supported(b.x.double(), b.router.double(), b.w13.double(), b.w2.double(), spec)
    assert not moe_block_supported(b.x.float(), b.router, b.w13, b.w2, spec)  # weights in another dtype
    assert not moe_block_supported(b.x, b.router, b.w13, b.w2, RouterSpec(9))


def test_launcher_names_what_it_refuses() -> None:
    b = make_block(8, 64, 32)
    spec = RouterSpec(2)

    def call(ws: MoeBlockWorkspace | None = None, out: torch.Tensor | None = None,
             expert_load: torch.Tensor | None = None, **changes: torch.Tensor) -> None:
        a = b._replace(**changes)
        moe_block_decode(a.x, a.residual, a.norm_weight, EPS, a.router, a.w13, a.w2, spec,
                         ws or MoeBlockWorkspace.allocate(8, 2, 32, 64, torch.bfloat16, DEVICE), out=out,
                         expert_load=expert_load)

    with pytest.raises(AssertionError, match="one row"):
        call(x=torch.cat([b.x, b.x]))
    with pytest.raises(AssertionError, match="the block runs"):
        call(x=b.x.double())
    with pytest.raises(AssertionError, match="residual must be"):
        call(residual=b.residual.half())
    with pytest.raises(AssertionError, match="w13 must be"):
        call(w13=b.w13[:, :32])
    with pytest.raises(AssertionError, match="w2 must be"):
        call(w2=b.w2.to(torch.float8_e4m3fn))
    with pytest.raises(AssertionError, match=r"workspace\.inter must be"):
        call(MoeBlockWorkspace.allocate(8, 2, 16, 64, torch.bfloat16, DEVICE))
    with pytest.raises(AssertionError, match="expert_load must be"):
        call(expert_load=torch.zeros(8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(AssertionError, match="out must be"):
        call(out=torch.empty(1, 64, dtype=torch.float16, device=DEVICE))
    with pytest.raises(AssertionError, match="top_k 9 exceeds"):
        moe_block_decode(b.x, b.residual, b.norm_weight, EPS, b.router, b.w13, b.w2, RouterSpec(9),
                         MoeBlockWorkspace.allocate(8, 8, 32, 64, torch.bfloat16, DEVICE))


def test_programs_per_sm_from_registers_threads_and_shared_memory() -> None:
    assert fitting_ctas(96, 20512, 4) == 5  # registers: 96 x 128 threads each
    assert fitting_ctas(32, 20512, 4) == 10  # shared memory: 21.5 KiB each of 228
    assert fitting_ctas(16, 0, 16) == 4  # threads: 512 each of 2048
    assert fitting_ctas(16, 0, 1) == HOPPER_SM.ctas
    assert fitting_ctas(255, 0, 16) == 0  # (the launcher refuses it)


def test_block_config() -> None:
    qwen3 = block_default_config(128, 768, 2048, 8, torch.device("cuda"))  # the H200 sweep's best
    tiles = (qwen3.block_i, qwen3.up_block_k, qwen3.block_h, qwen3.down_block_k, qwen3.ctas_per_sm)
    assert tiles == (4, 512, 4, 256, 4)
    other = block_default_config(64, 1408, 2048, 6, torch.device("cuda"))  # an untuned shape: the defaults
    assert (other.block_i, other.up_block_k, other.block_h, other.down_block_k) == (8, 256, 4, 128)
    assert block_default_config(128, 768, 2048, 8, torch.device("cpu")).num_warps == 1
    with pytest.raises(AssertionError, match="power of 2"):
        MoeBlockConfig(block_i=12)
    with pytest.raises(AssertionError, match="ctas_per_sm"):
        MoeBlockConfig(ctas_per_sm=0)
