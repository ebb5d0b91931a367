"""The decode-batch GEMM kernel vs a float32 matmul (under the Triton interpreter without CUDA)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.kernels.skinny_gemm import MAX_ROWS, SHARED_BYTES, SkinnyConfig, default_config, skinny_gemm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("m,n,k,config", [
    (16, 64, 256, SkinnyConfig(16, 32, 64)),     # even everywhere
    (5, 70, 200, SkinnyConfig(16, 32, 64)),      # ragged rows, features and K
    (40, 96, 128, SkinnyConfig(16, 32, 64, num_warps=8, num_stages=3)),  # three row blocks of one weight tile
    (3, 50, 48, None),                           # the default configuration; K shorter than one tile
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_skinny_gemm_matches_float32_matmul(m, n, k, config, dtype):
    gen = torch.Generator().manual_seed(m * n * k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    want = x.float() @ w.float().t()
    got = skinny_gemm(x.to(DEVICE), w.to(DEVICE), config=config)
    assert got.shape == (m, n) and got.dtype == dtype
    assert float((got.cpu().float() - want).norm() / want.norm()) < TOL[dtype]


def test_rows_of_a_wider_buffer_into_an_out_view() -> None:
    x = torch.randn(4, 96).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(40, 64) * 0.05).to(torch.bfloat16).to(DEVICE)
    out = torch.zeros(4, 80, dtype=torch.bfloat16, device=DEVICE)
    got = skinny_gemm(x[:, :64], w, out=out[:, 8:48], config=SkinnyConfig(16, 32, 32))
    want = x[:, :64].float() @ w.float().t()
    assert float((out[:, 8:48].float() - want).norm() / want.norm()) < 1e-2
    assert torch.equal(got, out[:, 8:48]) and not out[:, :8].any() and not out[:, 48:].any()


def test_the_launcher_says_what_is_wrong() -> None:
    w = torch.zeros(8, 16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(AssertionError, match="features"):
        skinny_gemm(torch.zeros(2, 12, dtype=torch.bfloat16, device=DEVICE), w)
    with pytest.raises(AssertionError, match="at most"):
        skinny_gemm(torch.zeros(MAX_ROWS + 1, 16, dtype=torch.bfloat16, device=DEVICE), w)
    with pytest.raises(AssertionError, match="fp16 or bf16"):
        skinny_gemm(torch.zeros(2, 16, device=DEVICE), w.float())
    assert skinny_gemm(torch.zeros(0, 16, dtype=torch.bfloat16, device=DEVICE), w).shape == (0, 8)


def test_default_tiles() -> None:
    assert default_config(168, 28672, 4096).block_m == 128  # two row blocks above 128 rows
    assert default_config(8, 4096, 4096).block_m == 16  # tensor-core tiles need 16 rows
    assert default_config(64, 4096, 4096).block_n == 64  # 64 programs of 128 features would leave SMs idle
    big = default_config(168, 28672, 4096)
    assert big.num_stages * (big.block_m + big.block_n) * big.block_k * 2 <= SHARED_BYTES
