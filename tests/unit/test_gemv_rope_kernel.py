"""The batch-1 q/k/v GEMV with the norm before it and the rotary embedding and KV store after it
(`radixmesh.kernels.gemv_rope`) against the two launches it replaces (`gemv_add_rmsnorm` with the same tiles,
then `apply_rotary_` with a KV store, and with Qwen3's q/k norms), under the Triton interpreter without CUDA: the
same outputs, the same pool rows (bf16 and FP8 pools), every other slot untouched; bf16/fp32 and FP8 weights."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.kernels.fp8_ref import quantize_rows as quantize_rows_ref
from radixmesh.kernels.fused import KVStoreTarget, QKNorm, apply_rotary_
from radixmesh.kernels.gemv import GemvConfig
from radixmesh.kernels.gemv_fused import gemv_add_rmsnorm
from radixmesh.kernels.gemv_rope import RopeStore, gemv_add_rmsnorm_rope, rope_block_n, rope_config

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-5
SLOTS = 9


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE)


def _caches(head_dim: int, positions: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    return freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


def _setup(hq: int, hkv: int, d: int, k: int, dtype: torch.dtype, fp8: bool, seed: int = 0):
    n = (hq + 2 * hkv) * d
    x, residual = _rand(1, k, seed=seed + 1).to(dtype), _rand(1, k, seed=seed + 2).to(dtype)
    nw = (1.0 + _rand(k, seed=seed + 3, scale=0.1)).to(dtype)
    w = _rand(n, k, seed=seed + 4, scale=0.05)
    if fp8:
        wq, ws = quantize_rows_ref(w.cpu())
        weights = (wq.to(DEVICE), ws.to(DEVICE))
    else:
        weights = (w.to(dtype), None)
    return x, residual, nw, weights


_SHAPES = [(4, 2, 16, 64, GemvConfig(4, 32)), (3, 1, 32, 70, GemvConfig(8, 32)), (2, 2, 8, 48, GemvConfig(2, 64))]
_FP32, _BF16, _BF16_FP8 = (torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)
_FP8_POOL = torch.float8_e4m3fn
# every weight kind on the even shape; the ragged K, one KV head and the smallest head with both pool kinds
CASES = [(*_SHAPES[0], *w, None) for w in (_FP32, _BF16, _BF16_FP8)] + [
    (*_SHAPES[1], *_BF16_FP8, None), (*_SHAPES[1], *_BF16_FP8, _FP8_POOL), (*_SHAPES[1], *_FP32, _FP8_POOL),
    (*_SHAPES[2], *_BF16, _FP8_POOL), (*_SHAPES[2], *_BF16_FP8, None)]


@pytest.mark.parametrize("hq,hkv,d,k,config,dtype,fp8,pool_dtype", CASES)
def test_fused_rope_equals_the_gemv_then_the_rotary_store(hq: int, hkv: int, d: int, k: int, config: GemvConfig,
                                                          dtype: torch.dtype, fp8: bool,
                                                          pool_dtype: torch.dtype | None) -> None:
    x, residual, nw, (w, ws) = _setup(hq, hkv, d, k, dtype, fp8)
    cos, sin = _caches(d)
    position, slot = 37, 5
    positions = torch.tensor([position], device=DEVICE)
    loc = torch.tensor([slot], device=DEVICE)
    pool_dtype = pool_dtype or dtype
    k_scale, v_scale = (0.5, 0.25) if pool_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    fill = torch.full((SLOTS, hkv, d), 3.0, device=DEVICE).to(pool_dtype)
    want_k, want_v, got_k, got_v = fill.clone(), fill.clone(), fill.clone(), fill.clone()

    # the launches it replaces
    qkv, want_summed = gemv_add_rmsnorm(x, residual, nw, EPS, w, ws, config=config)
    q_, k_, v_ = qkv.view(1, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
    apply_rotary_(q_, k_, positions, cos, sin, KVStoreTarget(v_.contiguous(), want_k, want_v, loc, k_scale, v_scale))

    rope = RopeStore(positions, cos, sin, got_k, got_v, loc, hq, hkv, d, k_scale, v_scale)
    got, summed = gemv_add_rmsnorm_rope(x, residual, nw, EPS, w, ws, rope, config=config)
    assert torch.equal(summed, want_summed)
    # compiled, the dot products may be summed in another order (other tiles): one rounding step of the dtype
    tol = dict(atol=0.0, rtol=0.0) if DEVICE.type == "cpu" else dict(atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(got.float(), qkv.float(), **tol)
    fp8_tol = tol if pool_dtype != torch.float8_e4m3fn or DEVICE.type == "cpu" else dict(atol=1e-2, rtol=0.13)
    torch.testing.assert_close(got_k.float(), want_k.float(), **fp8_tol)
    torch.testing.assert_close(got_v.float(), want_v.float(), **fp8_tol)
    others = [s for s in range(SLOTS) if s != slot]
    assert torch.equal(got_k[others].float(), fill[others].float()) and torch.equal(got_v[others].float(),
                                                                                    fill[others].float())


def test_block_that_does_not_tile_half_a_head_is_refused() -> None:
    assert rope_block_n(GemvConfig(8, 64), 16) == 4
    assert rope_block_n(GemvConfig(32, 64), 16) is None  # 16 rows of each half; a half head has 8
    assert rope_block_n(GemvConfig(4, 64), 128) == 2
    x, residual, nw, (w, ws) = _setup(2, 1, 16, 32, torch.float32, False)
    cos, sin = _caches(16)
    one = torch.tensor([0], device=DEVICE)
    pool = torch.zeros(SLOTS, 1, 16, device=DEVICE)
    with pytest.raises(AssertionError, match="do not tile head_dim 16"):
        gemv_add_rmsnorm_rope(x, residual, nw, EPS, w, ws, RopeStore(one, cos, sin, pool, pool.clone(), one, 2, 1, 16),
                              config=GemvConfig(32, 64))


def test_launcher_names_a_head_count_that_does_not_match_the_weight() -> None:
    x, residual, nw, (w, ws) = _setup(2, 1, 16, 32, torch.float32, False)
    cos, sin = _caches(16)
    one = torch.tensor([0], device=DEVICE)
    pool = torch.zeros(SLOTS, 1, 16, device=DEVICE)
    with pytest.raises(AssertionError, match="weight has 64 rows; q/k/v heads 3/1/1 of 16 features need 80"):
        gemv_add_rmsnorm_rope(x, residual, nw, EPS, w, ws, RopeStore(one, cos, sin, pool, pool.clone(), one, 3, 1, 16))
    with pytest.raises(AssertionError, match="positions must hold the one token"):
        two = torch.tensor([0, 1], device=DEVICE)
        gemv_add_rmsnorm_rope(x, residual, nw, EPS, w, ws, RopeStore(two, cos, sin, pool, pool.clone(), one, 2, 1, 16))


def test_an_addend_joins_the_projection_before_the_rotation() -> None:
    hq, hkv, d, k, config = _SHAPES[1]
    x, residual, nw, (w, ws) = _setup(hq, hkv, d, k, torch.float32, False, seed=7)
    cos, sin = _caches(d)
    positions, loc = torch.tensor([11], device=DEVICE), torch.tensor([2], device=DEVICE)
    addend = _rand(1, (hq + 2 * hkv) * d, seed=12)
    want_k, want_v = torch.zeros(SLOTS, hkv, d, device=DEVICE), torch.zeros(SLOTS, hkv, d, device=DEVICE)
    got_k, got_v = want_k.clone(), want_v.clone()
    qkv, _ = gemv_add_rmsnorm(x, residual, nw, EPS, w, ws, config=config, addend=addend)  # tested on its own
    q_, k_, v_ = qkv.view(1, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
    apply_rotary_(q_, k_, positions, cos, sin, KVStoreTarget(v_.contiguous(), want_k, want_v, loc, 1.0, 1.0))
    rope = RopeStore(positions, cos, sin, got_k, got_v, loc, hq, hkv, d)
    got, _ = gemv_add_rmsnorm_rope(x, residual, nw, EPS, w, ws, rope, config=config, addend=addend)
    tol = dict(atol=0.0, rtol=0.0) if DEVICE.type == "cpu" else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, qkv, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    torch.testing.assert_close(got_v, want_v, **tol)


def _qk_norm(d: int, dtype: torch.dtype, seed: int) -> QKNorm:
    q_weight, k_weight = (1.0 + _rand(d, seed=seed, scale=0.2)), (1.0 + _rand(d, seed=seed + 1, scale=0.2))
    return QKNorm(q_weight.to(dtype), k_weight.to(dtype), 1e-6)


# (q heads, kv heads, head_dim, K, tiles: head_dim rows a program); the same weight kinds and pools as above
_NORM_SHAPES = [(4, 2, 16, 64, GemvConfig(16, 32)), (3, 1, 32, 70, GemvConfig(32, 16, 2)),
                (2, 2, 8, 48, GemvConfig(8, 64))]
NORM_CASES = [(*_NORM_SHAPES[0], *w, None) for w in (_FP32, _BF16, _BF16_FP8)] + [
    (*_NORM_SHAPES[1], *_BF16, _FP8_POOL), (*_NORM_SHAPES[1], *_FP32, None), (*_NORM_SHAPES[2], *_BF16_FP8, _FP8_POOL)]


@pytest.mark.parametrize("hq,hkv,d,k,config,dtype,fp8,pool_dtype", NORM_CASES)
def test_qk_norms_in_the_fused_kernel_equal_the_rotary_kernel_with_them(
        hq: int, hkv: int, d: int, k: int, config: GemvConfig, dtype: torch.dtype, fp8: bool,
        pool_dtype: torch.dtype | None) -> None:
    x, residual, nw, (w, ws) = _setup(hq, hkv, d, k, dtype, fp8, seed=3)
    norm = _qk_norm(d, dtype, seed=21)
    cos, sin = _caches(d)
    positions, loc, slot = torch.tensor([29], device=DEVICE), torch.tensor([4], device=DEVICE), 4
    pool_dtype = pool_dtype or dtype
    k_scale, v_scale = (0.5, 0.25) if pool_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    fill = torch.full((SLOTS, hkv, d), -2.0, device=DEVICE).to(pool_dtype)
    want_k, want_v, got_k, got_v = fill.clone(), fill.clone(), fill.clone(), fill.clone()

    # the launches it replaces: the q/k/v GEMV with the norm before it, then the q/k norms + rotary + store
    qkv, want_summed = gemv_add_rmsnorm(x, residual, nw, EPS, w, ws, config=config)
    q_, k_, v_ = qkv.view(1, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
    apply_rotary_(q_, k_, positions, cos, sin, KVStoreTarget(v_.contiguous(), want_k, want_v, loc, k_scale, v_scale),
                  norm)

    rope = RopeStore(positions, cos, sin, got_k, got_v, loc, hq, hkv, d, k_scale, v_scale, qk_norm=norm)
    got, summed = gemv_add_rmsnorm_rope(x, residual, nw, EPS, w, ws, rope, config=config)
    assert torch.equal(summed, want_summed)
    tol = dict(atol=0.0, rtol=0.0) if DEVICE.type == "cpu" else dict(atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(got.float(), qkv.float(), **tol)
    fp8_tol = tol if pool_dtype != torch.float8_e4m3fn or DEVICE.type == "cpu" else dict(atol=1e-2, rtol=0.13)
    torch.testing.assert_close(got_k.float(), want_k.float(), **fp8_tol)
    torch.testing.assert_close(got_v.float(), want_v.float(), **fp8_tol)
    others = [s for s in range(SLOTS) if s != slot]
    assert torch.equal(got_k[others].float(), fill[others].float()) and torch.equal(got_v[others].float(),
                                                                                    fill[others].float())


def test_qk_norm_tiles_hold_whole_heads() -> None:
    assert rope_block_n(GemvConfig(16, 64), 16, qk_norm=True) == 8
    assert rope_block_n(GemvConfig(8, 64), 16, qk_norm=True) is None  # a quarter of the head: no norm over it
    cfg = rope_config(5120, 2048, 128, fp8=False, qk_norm=True)
    assert cfg.block_n == 128 and rope_block_n(cfg, 128, qk_norm=True) == 64
    x, residual, nw, (w, ws) = _setup(2, 1, 16, 32, torch.float32, False)
    cos, sin = _caches(16)
    one = torch.tensor([0], device=DEVICE)
    pool = torch.zeros(SLOTS, 1, 16, device=DEVICE)
    rope = RopeStore(one, cos, sin, pool, pool.clone(), one, 2, 1, 16, qk_norm=_qk_norm(16, torch.float32, 1))
    with pytest.raises(AssertionError, match="whole heads"):
        gemv_add_rmsnorm_rope(x, residual, nw, EPS, w, ws, rope, config=GemvConfig(8, 32))
    bad = rope._replace(qk_norm=QKNorm(torch.ones(8, device=DEVICE), torch.ones(16, device=DEVICE), 1e-6))
    with pytest.raises(AssertionError, match="q_norm weight must be a contiguous"):
        gemv_add_rmsnorm_rope(x, residual, nw, EPS, w, ws, bad, config=GemvConfig(16, 32))
