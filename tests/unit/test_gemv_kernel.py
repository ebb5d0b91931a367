"""The batch-1 GEMV kernel vs a float32 matmul (under the Triton interpreter without CUDA)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.kernels.gemv import TUNED_FUSED, GemvConfig, default_config, fused_config, gemv, parse_tiles

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


def test_gemv_tiles_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """RADIXMESH_GEMV_TILES (read by the model runner, set with `set_tiles`) replaces tuned tiles, for sweeps inside
    a model; a value that does not read names its item."""
    from radixmesh.common.env import gemv_tiles
    from radixmesh.kernels import gemv as gemv_module

    value = "plain:2048x4096=8,4096,8,1; norm/fp8:5120x2048=4,2048,4,1"
    monkeypatch.setenv("RADIXMESH_GEMV_TILES", f" {value} ")
    assert gemv_tiles() == value
    tiles = parse_tiles(gemv_tiles())
    assert tiles == {("plain", "bf16", 2048, 4096): GemvConfig(8, 4096, 8, 1),
                     ("norm", "fp8", 5120, 2048): GemvConfig(4, 2048, 4, 1)}
    assert parse_tiles("") == {} == parse_tiles(None)
    for bad in ("plain:2048x4096=8,4096", "plain:2048x4096=8,0,8,1", "plain/int4:8x8=1,8,1,1"):
        with pytest.raises(ValueError, match="cannot read"):
            parse_tiles(bad)
    tuned_o, tuned_qkv = TUNED_FUSED[("plain", "bf16", 2048, 4096)], TUNED_FUSED[("norm", "bf16", 5120, 2048)]
    assert fused_config("plain", 2048, 4096, fp8=False) == tuned_o
    try:
        gemv_module.set_tiles(tiles)
        assert fused_config("plain", 2048, 4096, fp8=False) == GemvConfig(8, 4096, 8, 1)
        assert fused_config("norm", 5120, 2048, fp8=True) == GemvConfig(4, 2048, 4, 1)
        assert fused_config("norm", 5120, 2048, fp8=False) == tuned_qkv  # bf16 keeps its tuned tiles
    finally:
        gemv_module.set_tiles({})
    assert fused_config("plain", 2048, 4096, fp8=False) == tuned_o
    monkeypatch.setenv("RADIXMESH_GEMV_TILES", "  ")
    assert gemv_tiles() is None


def test_the_model_runner_sets_and_refuses_gemv_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the runner's fast-path setup sets RADIXMESH_GEMV_TILES's tiles, and refuses a value that does not
    read with INVALID_ARGUMENT naming the variable (before any kernel launches)."""
    from types import SimpleNamespace

    from radixmesh.common.errors import ErrorCode, RadixMeshError
    from radixmesh.engine import runner_build
    from radixmesh.kernels import gemv as gemv_module

    runner = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.float32,
                             config=SimpleNamespace(disable_pdl=True, disable_gemv=True, disable_gemv_fusion=False))
    monkeypatch.setenv("RADIXMESH_GEMV_TILES", "plain:2048x4096=8,4096")
    with pytest.raises(RadixMeshError) as err:
        runner_build._enable_fast_paths(runner, None)  # type: ignore[arg-type]
    assert err.value.code == ErrorCode.INVALID_ARGUMENT and "RADIXMESH_GEMV_TILES" in str(err.value)
    monkeypatch.setenv("RADIXMESH_GEMV_TILES", "plain:2048x4096=8,4096,8,1")
    try:
        runner_build._enable_fast_paths(runner, None)  # type: ignore[arg-type]
        overrides = dict(gemv_module.TILES_OVERRIDE)
        assert overrides == {("plain", "bf16", 2048, 4096): GemvConfig(8, 4096, 8, 1)}
    finally:
        gemv_module.set_tiles({})
