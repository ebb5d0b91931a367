"""The router GEMV with the add + RMSNorm before it, writing the normed row out (`radixmesh.kernels.gemv_norm_out`),
against the two launches it replaces (`fused.rms_norm` with the residual, then `gemv` with the same tiles), under
the Triton interpreter without CUDA: the new residual and the normed row bit for bit, the logits bit for bit on the
CPU (within one rounding step compiled); bf16/fp16/fp32, ragged shapes, one program and many."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.kernels.fused import rms_norm
from radixmesh.kernels.gemv import GemvConfig, gemv
from radixmesh.kernels.gemv_norm_out import MAX_ROW, gemv_add_rmsnorm_out

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE)


# (experts N, hidden K, tiles): many programs over even tiles, ragged N and K, one program, the default tiles
CASES = [(32, 256, GemvConfig(4, 64)), (70, 200, GemvConfig(8, 64)), (6, 96, GemvConfig(8, 32)), (40, 1000, None)]


@pytest.mark.parametrize("n,k,config", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_router_gemv_equals_the_norm_then_the_gemv(n: int, k: int, config: GemvConfig | None,
                                                   dtype: torch.dtype) -> None:
    x, residual = _rand(1, k, seed=n).to(dtype), _rand(1, k, seed=n + 1).to(dtype)
    nw = (1.0 + _rand(k, seed=n + 2, scale=0.2)).to(dtype)
    w = _rand(n, k, seed=n + 3, scale=0.05).to(dtype)
    want_h, want_summed = rms_norm(x, nw, EPS, residual)  # the launches it replaces
    want = gemv(want_h, w, config=config)
    got, h, summed = gemv_add_rmsnorm_out(x, residual, nw, EPS, w, config=config)
    assert got.shape == (1, n) and h.shape == summed.shape == (1, k)
    assert torch.equal(summed, want_summed)
    assert torch.equal(h, want_h)
    tol = dict(atol=0.0, rtol=0.0) if DEVICE.type == "cpu" else dict(atol=1e-5, rtol=1.6e-2)
    torch.testing.assert_close(got, want, **tol)


def test_launcher_names_what_it_refuses() -> None:
    x, residual, nw = _rand(1, 64, seed=1), _rand(1, 64, seed=2), torch.ones(64, device=DEVICE)
    with pytest.raises(AssertionError, match="the input has 64 features, weight expects 32"):
        gemv_add_rmsnorm_out(x, residual, nw, EPS, _rand(8, 32, seed=3))
    with pytest.raises(AssertionError, match=r"residual must be \[1, 64\]"):
        gemv_add_rmsnorm_out(x, _rand(2, 64, seed=4), nw, EPS, _rand(8, 64, seed=3))
    with pytest.raises(AssertionError, match=r"weight is torch\.bfloat16, the input is torch\.float32"):
        gemv_add_rmsnorm_out(x, residual, nw, EPS, _rand(8, 64, seed=3).to(torch.bfloat16))
    wide = MAX_ROW + 2
    with pytest.raises(AssertionError, match="wider than"):
        gemv_add_rmsnorm_out(torch.zeros(1, wide, device=DEVICE), torch.zeros(1, wide, device=DEVICE),
                             torch.ones(wide, device=DEVICE), EPS, torch.zeros(1, wide, device=DEVICE))
