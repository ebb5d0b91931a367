"""The GEMVs with a fused prologue (add + RMSNorm; gated: then SiLU-and-mul) against the launches they replace
(`radixmesh.kernels.fused`, then the product in float32; the normalized row in float32, which the fused
norm does not round; under the Triton interpreter without CUDA): the new residual bit for bit, the
output within the GEMV's own tolerance, bf16/fp16/fp32 and FP8 weights."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.kernels.fp8_ref import quantize_rows as quantize_rows_ref
from radixmesh.kernels.fused import rms_norm, silu_and_mul
from radixmesh.kernels.gemv import GemvConfig
from radixmesh.kernels.gemv_fused import gemv_add_rmsnorm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
EPS = 1e-5


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float().cpu() - want).norm() / want.norm())


def _weights(n: int, k: int, dtype: torch.dtype, fp8: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(weight, scale or None, the float32 matrix they stand for)."""
    w = _rand(n, k, seed=n + k, scale=0.05)
    if not fp8:
        w = w.to(dtype)
        return w, None, w.float()
    wq, ws = quantize_rows_ref(w)
    return wq, ws, wq.float() * ws[:, None]


CASES = [(64, 256, GemvConfig(8, 64)), (70, 200, GemvConfig(16, 64)), (5, 1000, None)]


@pytest.mark.parametrize("n,k,config", CASES)
@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
                                       (torch.bfloat16, True)])
def test_add_rmsnorm_gemv_equals_the_norm_then_the_gemv(n: int, k: int, config: GemvConfig | None,
                                                        dtype: torch.dtype, fp8: bool) -> None:
    x, residual = _rand(1, k, seed=1).to(dtype), _rand(1, k, seed=2).to(dtype)
    nw = (1.0 + _rand(k, seed=3, scale=0.1)).to(dtype)
    w, ws, w_f32 = _weights(n, k, dtype, fp8)
    _, want_summed = rms_norm(x.to(DEVICE), nw.to(DEVICE), EPS, residual.to(DEVICE))  # the launch it replaces
    assert want_summed is not None
    sf = want_summed.float().cpu()  # the normalized row in float32 (the fused kernel does not round it)
    want = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + EPS) * nw.float()) @ w_f32.t()
    got, summed = gemv_add_rmsnorm(x.to(DEVICE), residual.to(DEVICE), nw.to(DEVICE), EPS, w.to(DEVICE),
                                   ws.to(DEVICE) if ws is not None else None, config=config)
    assert torch.equal(summed.cpu(), want_summed.cpu())
    assert got.shape == (1, n) and got.dtype == dtype
    assert _rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("n,k,config", CASES)
@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_gated_norm_gemv_equals_the_norm_the_gemv_then_silu_and_mul(n: int, k: int, config: GemvConfig | None,
                                                                     dtype: torch.dtype, fp8: bool) -> None:
    x, residual = _rand(1, k, seed=5).to(dtype), _rand(1, k, seed=6).to(dtype)
    nw = (1.0 + _rand(k, seed=7, scale=0.1)).to(dtype)
    w, ws, w_f32 = _weights(2 * n, k, dtype, fp8)  # [gate; up]
    summed = (x.float() + residual.float()).to(dtype).float()
    gate_up = (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + EPS) * nw.float()) @ w_f32.t()
    want = silu_and_mul(gate_up.to(dtype).to(DEVICE)).float().cpu()  # the launch it replaces
    got, _ = gemv_add_rmsnorm(x.to(DEVICE), residual.to(DEVICE), nw.to(DEVICE), EPS, w.to(DEVICE),
                              ws.to(DEVICE) if ws is not None else None, gated=True, config=config)
    assert got.shape == (1, n) and got.dtype == dtype
    assert _rel_err(got, want) < 2 * TOL[dtype]


def test_the_fused_gemvs_check_their_inputs() -> None:
    x, w = torch.randn(1, 64).to(DEVICE), torch.randn(32, 64).to(DEVICE)
    nw = torch.ones(64).to(DEVICE)
    with pytest.raises(AssertionError, match="residual must be"):
        gemv_add_rmsnorm(x, torch.randn(1, 63).to(DEVICE), nw, EPS, w)
    with pytest.raises(AssertionError, match="norm_weight must be"):
        gemv_add_rmsnorm(x, x, nw[:10], EPS, w)
    with pytest.raises(AssertionError, match="weight expects"):
        gemv_add_rmsnorm(x, x, nw, EPS, torch.randn(32, 65).to(DEVICE))
    with pytest.raises(AssertionError, match="odd"):
        gemv_add_rmsnorm(x, x, nw, EPS, torch.randn(31, 64).to(DEVICE), gated=True)
    with pytest.raises(AssertionError, match="weight_scale must be"):
        wq, ws = quantize_rows_ref(torch.randn(32, 64))
        gemv_add_rmsnorm(x, x, nw, EPS, wq.to(DEVICE), ws[:3].to(DEVICE))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("n,k,config", CASES[:2])
def test_an_addend_joins_the_projection_before_the_epilogue(n: int, k: int, config: GemvConfig | None,
                                                            gated: bool) -> None:
    x, residual = _rand(1, k, seed=8), _rand(1, k, seed=9)
    nw = 1.0 + _rand(k, seed=10, scale=0.1)
    rows = 2 * n if gated else n
    w, _, _ = _weights(rows, k, torch.float32, False)
    addend = _rand(1, rows, seed=11)
    summed = x + residual
    proj = (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + EPS) * nw) @ w.t() + addend
    want = torch.nn.functional.silu(proj[:, :n]) * proj[:, n:] if gated else proj
    got, _ = gemv_add_rmsnorm(x.to(DEVICE), residual.to(DEVICE), nw.to(DEVICE), EPS, w.to(DEVICE), gated=gated,
                              config=config, addend=addend.to(DEVICE))
    assert _rel_err(got, want) < 1e-5
    with pytest.raises(AssertionError, match="addend must be"):
        gemv_add_rmsnorm(x.to(DEVICE), residual.to(DEVICE), nw.to(DEVICE), EPS, w.to(DEVICE), gated=gated,
                         addend=addend[:, 1:].to(DEVICE))
