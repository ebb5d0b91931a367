"""The batch-1 GEMV kernel vs a float32 matmul (under the Triton interpreter without CUDA)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.kernels.gemv import GemvConfig, default_config, fused_config, gemv, parse_tiles

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


@pytest.mark.parametrize("n,k,config", [
    (64, 256, GemvConfig(8, 64)),        # even: no masks in the loop
    (70, 200, GemvConfig(16, 64)),       # ragged in N and K
    (5, 1000, None),                     # the default configuration, one program
    (300, 96, GemvConfig(4, 128, num_warps=8, num_stages=2)),  # K shorter than one tile
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemv_matches_float32_matmul(n, k, config, dtype):
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    want = x.float() @ w.float().t()
    got = gemv(x.to(DEVICE), w.to(DEVICE), config=config)
    assert got.shape == (1, n) and got.dtype == dtype
    assert _rel_err(got.cpu(), want) < TOL[dtype]
    flat = gemv(x[0].to(DEVICE), w.to(DEVICE), config=config)  # a 1-D input gives a 1-D output
    assert flat.shape == (n,) and torch.equal(flat.cpu(), got[0].cpu())


def test_gemv_writes_into_out_and_checks_its_inputs():
    x = torch.randn(1, 64).to(DEVICE)
    w = torch.randn(32, 64).to(DEVICE)
    out = torch.empty(1, 32, device=DEVICE)
    assert gemv(x, w, out) is out
    assert _rel_err(out.cpu(), x.cpu() @ w.cpu().t()) < 1e-5
    with pytest.raises(AssertionError, match="features"):
        gemv(torch.randn(1, 63).to(DEVICE), w)
    with pytest.raises(AssertionError, match=r"\[K\] or \[1, K\]"):
        gemv(torch.randn(2, 64).to(DEVICE), w)
    with pytest.raises(AssertionError, match=r"is torch\.bfloat16"):
        gemv(x.to(torch.bfloat16), w)
    with pytest.raises(AssertionError, match="out must be"):
        gemv(x, w, torch.empty(1, 31, device=DEVICE))


def test_default_config_is_tuned_or_many_small_programs():
    from radixmesh.kernels.gemv import TUNED

    assert default_config(4096, 4096) == TUNED[(4096, 4096)]
    assert default_config(1000, 3000) == GemvConfig(4, 512, 4, 4)  # K in tiles of 512 at most
    assert default_config(3, 300) == GemvConfig(4, 512, 4, 4)  # K rounded up to a power of two
    assert default_config(3, 100) == GemvConfig(4, 128, 4, 4)  # one tile covers a short K
    assert default_config(3, 5) == GemvConfig(4, 64, 4, 4)  # never under 64


def test_gemv_tiles_from_the_environment() -> None:
    """RADIXMESH_GEMV_TILES, read when the module loads, replaces tuned tiles (for sweeps inside a model)."""
    tiles = parse_tiles("plain:2048x4096=8,4096,8,1; norm/fp8:5120x2048=4,2048,4,1")
    assert tiles == {("plain", "bf16", 2048, 4096): GemvConfig(8, 4096, 8, 1),
                     ("norm", "fp8", 5120, 2048): GemvConfig(4, 2048, 4, 1)}
    assert parse_tiles("") == {} == parse_tiles(None)
    with pytest.raises(ValueError, match="RADIXMESH_GEMV_TILES"):
        parse_tiles("plain:2048x4096=8,4096")
    assert fused_config("plain", 2048, 4096, fp8=False) == GemvConfig(8, 512, 2, 4)  # the tuned tiles
