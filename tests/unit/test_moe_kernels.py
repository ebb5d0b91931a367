"""MoE kernels (routing, placement by expert, grouped GEMMs, combine) vs `moe_ref`, at tiny shapes.

Without CUDA the kernels run under the Triton interpreter, whose float32 -> bf16 cast truncates: bf16 and
FP8 cases get looser bounds than float32 ones, which check the arithmetic to rounding.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.kernels.fp8_ref import quantize_rows
from radixmesh.kernels.moe import MoeWorkspace, fused_moe
from radixmesh.kernels.moe_config import (
    DTYPE_KEYS,
    HOPPER_SMEM_BYTES,
    M_BUCKETS,
    TUNED,
    MoeConfig,
    MoeGemmConfig,
    default_config,
    dtype_key,
    m_bucket,
)
from radixmesh.kernels.moe_gemm import check_tiles_fit
from radixmesh.kernels.moe_ref import moe_ref, route_ref
from radixmesh.kernels.moe_routing import MoeAlignment, RouterSpec, max_blocks, route_align, route_rows

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALL = MoeGemmConfig(16, 32, 2, 1, 1)
OTHER_TILES = [  # the GPU tests' tiles besides the defaults (tests/gpu/test_moe_gpu.py)
    MoeConfig(1, MoeGemmConfig(32, 256), MoeGemmConfig(16, 512)),  # register path
    MoeConfig(32, MoeGemmConfig(64, 128, 8, 4, 4), MoeGemmConfig(128, 64, 8, 8, 3)),
    MoeConfig(64, MoeGemmConfig(128, 128, 8, 8, 2), MoeGemmConfig(64, 256, 8, 4, 3)),
]
# (activation, weight) element bytes per dtype key
KEY_BYTES = {"bf16": (2, 2), "fp16": (2, 2), "fp32": (4, 4), "fp8-w8a16": (2, 1), "fp8-w8a8": (1, 1)}


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _experts(num: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return (_rand(num, 2 * inter, hidden, seed=seed, scale=0.2).to(dtype),
            _rand(num, hidden, inter, seed=seed + 1, scale=0.2).to(dtype))


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel, per expert: (`[E, N, K]` e4m3, `[E, N]` float32)."""
    q, s = quantize_rows(w.float().reshape(-1, w.shape[2]))
    return q.reshape(w.shape), s.reshape(w.shape[:2])


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float().cpu() - want.float()).norm() / want.float().norm())


def check_alignment(al: MoeAlignment, ids: torch.Tensor, expert_start: int = 0) -> None:
    """Every local assignment placed once, in its expert's blocks, in token order; blocks as few as possible."""
    ids = ids.cpu()
    block_expert, block_rows = al.block_expert.tolist(), al.block_rows.tolist()
    sorted_ids = al.sorted_ids.cpu()
    assert al.num_blocks == max_blocks(ids.numel(), al.num_local, al.block_m)
    placed: dict[int, list[int]] = {}
    for b, (e, rows) in enumerate(zip(block_expert, block_rows)):
        if e < 0:
            assert rows == 0 and all(x < 0 for x in block_expert[b:]), "unused blocks come last"
            continue
        assert 1 <= rows <= al.block_m
        got = sorted_ids[b * al.block_m:b * al.block_m + rows].tolist()
        assert all(int(ids.view(-1)[t]) == e + expert_start for t in got), f"block {b} holds another expert's rows"
        placed.setdefault(e, []).extend(got)
        assert rows == al.block_m or b + 1 == len(block_expert) or block_expert[b + 1] != e, "a short block mid-expert"
    for e in range(al.num_local):
        want = [t for t in range(ids.numel()) if int(ids.view(-1)[t]) == e + expert_start]
        assert placed.get(e, []) == want, f"expert {e}: placed {placed.get(e)}, want {want} (token order)"


# ---- routing --------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,bias", [
    (RouterSpec(4), False),
    (RouterSpec(4, renormalize=False), False),
    (RouterSpec(3, scoring="sigmoid", routed_scaling_factor=2.5), True),
    (RouterSpec(2, scoring="sigmoid", renormalize=False), False),
])
def test_route_matches_reference(spec: RouterSpec, bias: bool) -> None:
    logits = _rand(6, 12, seed=spec.top_k).to(torch.bfloat16)
    correction = _rand(12, seed=9, scale=0.5) if bias else None
    al = route_align(logits.to(DEVICE), spec, 4, correction_bias=None if correction is None else correction.to(DEVICE))
    weights, ids = route_ref(logits, spec.top_k, spec.scoring, spec.renormalize, spec.routed_scaling_factor,
                             correction)
    assert torch.equal(al.topk_ids.cpu(), ids)
    torch.testing.assert_close(al.topk_weights.cpu(), weights, rtol=1e-5, atol=1e-6)
    check_alignment(al, ids)


def test_route_ties_go_to_the_lower_expert() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0, 0.0, 0.0],
                           [2.0] * 8,
                           [0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 5.0]])
    al = route_align(logits.to(DEVICE), RouterSpec(3), 2)
    assert al.topk_ids.tolist() == [[1, 2, 4], [0, 1, 2], [2, 7, 0]]
    assert torch.equal(al.topk_ids.cpu(), route_ref(logits, 3)[1])
    torch.testing.assert_close(al.topk_weights.cpu()[1], torch.full((3,), 1 / 3))


@pytest.mark.parametrize("m,num_experts,top_k,block_m", [
    (2, 16, 2, 4),     # most experts get no token
    (9, 8, 2, 1),      # one row per block
    (100, 8, 2, 16),   # two launches (more tokens than one routing program takes)
    (40, 128, 8, 16),  # Qwen3-MoE's router width, two launches
])
def test_alignment_places_every_assignment(m: int, num_experts: int, top_k: int, block_m: int) -> None:
    logits = _rand(m, num_experts, seed=m)
    assert (m > route_rows(num_experts)) == (m in (100, 40))
    al = route_align(logits.to(DEVICE), RouterSpec(top_k), block_m)
    assert torch.equal(al.topk_ids.cpu(), route_ref(logits, top_k)[1])
    check_alignment(al, al.topk_ids)


@pytest.mark.parametrize("expert_start,num_local", [(0, 6), (2, 3), (5, 1)])
def test_alignment_of_given_ids_keeps_only_local_experts(expert_start: int, num_local: int) -> None:
    ids = torch.tensor([[0, 5], [5, 1], [3, 2], [4, 5], [2, 0]], dtype=torch.int32)  # expert 1 once, none on 3+ ranks
    al = route_align(None, RouterSpec(2), 2, num_experts=6, topk_ids=ids.to(DEVICE), expert_start=expert_start,
                     num_local=num_local)
    check_alignment(al, ids, expert_start)


@pytest.mark.parametrize("m", [5, 100])  # one launch, two launches
def test_expert_load_adds_every_experts_assignments(m: int) -> None:
    logits = _rand(m, 16, seed=m + 1)
    load = torch.full((16,), 7, dtype=torch.int64, device=DEVICE)
    for _ in range(2):  # counts add up across calls (a model sums its layers and steps)
        route_align(logits.to(DEVICE), RouterSpec(3), 4, expert_start=4, num_local=4, expert_load=load)
    want = torch.bincount(route_ref(logits, 3)[1].view(-1).long(), minlength=16)
    assert load.cpu().tolist() == (7 + 2 * want).tolist()  # all 16 experts, not only the 4 local ones


def test_alignment_of_an_empty_batch_has_no_used_blocks() -> None:
    al = route_align(torch.empty(0, 8, device=DEVICE), RouterSpec(2), 16)
    assert al.num_blocks == 0 and al.topk_ids.shape == (0, 2)


# ---- the layer ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("m,block_m", [(1, 16), (7, 16), (7, 4), (5, 1)])
def test_fused_moe_matches_reference(dtype: torch.dtype, tol: float, m: int, block_m: int) -> None:
    x, logits = _rand(m, 64, seed=m).to(dtype), _rand(m, 8, seed=m + 1)
    w13, w2 = _experts(8, 64, 32, dtype)
    got = fused_moe(x.to(DEVICE), logits.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), RouterSpec(2),
                    config=MoeConfig(block_m, SMALL, SMALL), path="sorted")
    weights, ids = route_ref(logits, 2)
    assert got.shape == (m, 64) and got.dtype == dtype
    assert _rel_err(got, moe_ref(x, w13, w2, weights, ids)) < tol


def test_fused_moe_two_launch_routing_and_ragged_k() -> None:
    x, logits = _rand(70, 40, seed=3), _rand(70, 8, seed=4)  # hidden 40: K tails in the gate/up loop
    w13, w2 = _experts(8, 40, 24, torch.float32)
    got = fused_moe(x.to(DEVICE), logits.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), RouterSpec(2),
                    config=MoeConfig(16, SMALL, SMALL))
    weights, ids = route_ref(logits, 2)
    assert _rel_err(got, moe_ref(x, w13, w2, weights, ids)) < 1e-5


@pytest.mark.parametrize("fp8_activations,block_m", [(False, 16), (True, 16), (True, 2)])
def test_fused_moe_fp8_experts(fp8_activations: bool, block_m: int) -> None:
    x, logits = _rand(6, 64, seed=5).to(torch.bfloat16), _rand(6, 8, seed=6)
    (q13, s13), (q2, s2) = (_fp8(w) for w in _experts(8, 64, 32, torch.float32))
    got = fused_moe(x.to(DEVICE), logits.to(DEVICE), q13.to(DEVICE), q2.to(DEVICE), RouterSpec(2),
                    w13_scale=s13.to(DEVICE), w2_scale=s2.to(DEVICE), fp8_activations=fp8_activations,
                    config=MoeConfig(block_m, SMALL, SMALL))
    weights, ids = route_ref(logits, 2)
    want = moe_ref(x, q13, q2, weights, ids, s13, s2, fp8_activations)
    assert _rel_err(got, want) < 3e-2


def test_expert_parallel_ranks_sum_to_the_whole_layer() -> None:
    x, logits = _rand(5, 32, seed=7), _rand(5, 8, seed=8)
    w13, w2 = _experts(8, 32, 16, torch.float32)
    spec, cfg = RouterSpec(3), MoeConfig(16, SMALL, SMALL)
    args = (x.to(DEVICE), logits.to(DEVICE))
    whole = fused_moe(*args, w13.to(DEVICE), w2.to(DEVICE), spec, config=cfg)
    parts = [fused_moe(*args, w13[lo:lo + 4].to(DEVICE), w2[lo:lo + 4].to(DEVICE), spec, expert_start=lo, config=cfg)
             for lo in (0, 4)]
    torch.testing.assert_close((parts[0] + parts[1]).cpu(), whole.cpu(), rtol=1e-5, atol=1e-5)
    weights, ids = route_ref(logits, 3)
    assert _rel_err(parts[1], moe_ref(x, w13[4:], w2[4:], weights, ids, expert_start=4)) < 1e-5


def test_workspace_is_reused_across_batch_sizes() -> None:
    w13, w2 = _experts(8, 32, 16, torch.float32)
    ws = MoeWorkspace.allocate(16, 2, 8, 8, 32, 16, torch.float32, DEVICE, max_block_m=16)
    out = torch.empty(16, 32, device=DEVICE)
    for m in (9, 3, 0):
        x, logits = _rand(m, 32, seed=m), _rand(m, 8, seed=m + 20)
        got = fused_moe(x.to(DEVICE), logits.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), RouterSpec(2),
                        config=MoeConfig(16, SMALL, SMALL), workspace=ws, out=out[:m], path="sorted")
        if m:
            weights, ids = route_ref(logits, 2)
            assert _rel_err(got, moe_ref(x, w13, w2, weights, ids)) < 1e-5


def test_fused_moe_checks_its_inputs() -> None:
    x, logits = torch.randn(3, 32, device=DEVICE), torch.randn(3, 8, device=DEVICE)
    w13, w2 = (w.to(DEVICE) for w in _experts(8, 32, 16, torch.float32))
    spec, cfg = RouterSpec(2), MoeConfig(16, SMALL, SMALL)
    with pytest.raises(AssertionError, match="router_logits must be"):
        fused_moe(x, logits[:2], w13, w2, spec, config=cfg, path="sorted")
    with pytest.raises(AssertionError, match="weights must be"):
        fused_moe(x, logits, w13, w2[:, :, :8], spec, config=cfg, path="sorted")
    with pytest.raises(AssertionError, match="activations are"):
        fused_moe(x, logits, w13.bfloat16(), w2.bfloat16(), spec, config=cfg, path="sorted")
    with pytest.raises(AssertionError, match="both w13_scale and w2_scale"):
        fused_moe(x, logits, w13, w2, spec, w13_scale=torch.ones(8, 32, device=DEVICE), config=cfg, path="sorted")
    with pytest.raises(AssertionError, match="top_k 9 exceeds"):
        fused_moe(x, logits, w13, w2, RouterSpec(9), config=cfg, path="sorted")
    with pytest.raises(AssertionError, match="local experts"):
        fused_moe(x, logits, w13, w2, spec, expert_start=4, config=cfg, path="sorted")
    small = MoeWorkspace.allocate(2, 2, 8, 8, 32, 16, torch.float32, DEVICE, max_block_m=16)
    with pytest.raises(AssertionError, match="buffers hold"):
        fused_moe(x, logits, w13, w2, spec, config=cfg, workspace=small, path="sorted")
    with pytest.raises(AssertionError, match="scoring must be"):
        RouterSpec(2, scoring="relu")


def test_configs_by_shape_and_batch() -> None:
    assert [m_bucket(m) for m in (1, 3, 64, 65, 100000)] == [1, 4, 64, 128, 4096]
    assert dtype_key(torch.bfloat16, True, False) == "fp8-w8a16" and dtype_key(torch.float16, False, False) == "fp16"
    gpu = torch.device("cuda")
    decode = default_config(128, 768, 2048, "bf16", 1, 8, gpu)
    prefill = default_config(128, 768, 2048, "bf16", 8192, 8, gpu)
    assert decode.block_m == 16 and prefill.block_m == 128 and prefill.up.block_n >= decode.up.block_n
    tuned = MoeConfig(1, MoeGemmConfig(32, 512), MoeGemmConfig(64, 256))
    TUNED[(128, 768, 2048, "bf16", 2)] = tuned
    try:
        assert default_config(128, 768, 2048, "bf16", 2, 8, gpu) is tuned
    finally:
        del TUNED[(128, 768, 2048, "bf16", 2)]
    with pytest.raises(AssertionError, match="power of 2"):
        MoeConfig(12, SMALL, SMALL)


def test_tiles_fit_in_hopper_shared_memory() -> None:
    # 128x128 gate and up tiles at block_m 64 in 3 stages: the 245760 bytes an H200 refused to compile
    over = MoeGemmConfig(128, 128, 8, 8, 3)
    assert over.smem_bytes(64, 2, 2, gated=True) == 245760 > HOPPER_SMEM_BYTES
    with pytest.raises(AssertionError, match="need 245760 bytes of shared memory"):
        check_tiles_fit(over, 64, torch.bfloat16, torch.bfloat16, True, HOPPER_SMEM_BYTES)
    check_tiles_fit(over, 64, torch.bfloat16, torch.bfloat16, False, HOPPER_SMEM_BYTES)  # one weight tile
    check_tiles_fit(over, 64, torch.bfloat16, torch.float8_e4m3fn, True, HOPPER_SMEM_BYTES)  # FP8 weights
    for cfg in OTHER_TILES:
        if cfg.block_m >= 16:
            check_tiles_fit(cfg.up, cfg.block_m, torch.bfloat16, torch.bfloat16, True, HOPPER_SMEM_BYTES)
            check_tiles_fit(cfg.down, cfg.block_m, torch.bfloat16, torch.bfloat16, False, HOPPER_SMEM_BYTES)


@pytest.mark.parametrize("key", DTYPE_KEYS)
def test_default_tiles_fit_in_hopper_shared_memory(key: str) -> None:
    a_bytes, w_bytes = KEY_BYTES[key]
    for experts, inter, hidden, top_k in ((128, 768, 2048, 8), (8, 14336, 4096, 2), (256, 2048, 7168, 8)):
        for m in M_BUCKETS:
            cfg = default_config(experts, inter, hidden, key, m, top_k, torch.device("cuda"))
            for tiles, gated in ((cfg.up, True), (cfg.down, False)):
                need = tiles.smem_bytes(cfg.block_m, a_bytes, w_bytes, gated)
                assert need <= HOPPER_SMEM_BYTES, f"{key} M={m}: {cfg} needs {need} bytes"
