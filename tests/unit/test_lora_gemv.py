"""The batch-1 LoRA shrink and the expand in the GEMVs' epilogues (`radixmesh.kernels.lora_gemv`) against the
reference on the projection's input, under the Triton interpreter without CUDA: the plain GEMV, the norm GEMV
(plain and gated) and the q/k/v GEMV with the rotary store; mixed ranks below the slots' R (8, 16, 64), stacked
slices, K split over several programs, and a base row and an empty slot adding nothing."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.kernels.gemv import GemvConfig, gemv
from radixmesh.kernels.gemv_fused import gemv_add_rmsnorm
from radixmesh.kernels.gemv_rope import RopeStore, gemv_add_rmsnorm_rope
from radixmesh.kernels.lora_gemv import LoraEpilogue, lora_gemv_shrink, shrink_tiles
from radixmesh.kernels.lora_ref import lora_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-5
MAX_RANK = 64
RANKS = [8, 64, 16, 0]  # slot 3 empty
SCALINGS = [2.0, 0.5, 1.0, 1.0]


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _slots(k: int, slices: tuple[int, ...], max_rank: int = MAX_RANK) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot buffers (a, b) with junk past each slot's rank, which the kernels must never read."""
    a = _rand(len(RANKS), len(slices) * max_rank, k, seed=4, scale=0.1)
    b = _rand(len(RANKS), sum(slices), max_rank, seed=5, scale=0.1)
    for s, rank in enumerate(RANKS):
        rank = min(rank, max_rank)
        b[s, :, rank:] = 1e4
        for i in range(len(slices)):
            a[s, i * max_rank + rank:(i + 1) * max_rank] = 1e4
    return a, b


def _shrink(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot: int, slices: tuple[int, ...],
            tiles: tuple[int, int, int] | None, residual: torch.Tensor | None = None,
            nw: torch.Tensor | None = None, ranks: list[int] = RANKS) -> LoraEpilogue:
    dtype = x.dtype
    return lora_gemv_shrink(
        x.to(DEVICE), a.to(DEVICE, dtype), b.to(DEVICE, dtype), torch.tensor([slot], dtype=torch.int32, device=DEVICE),
        torch.tensor(ranks, dtype=torch.int32, device=DEVICE), torch.tensor(SCALINGS, device=DEVICE), slices,
        None if residual is None else residual.to(DEVICE), None if nw is None else nw.to(DEVICE), tiles)


def _delta(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot: int, slices: tuple[int, ...]) -> torch.Tensor:
    """float32 `[1, N]`: the reference adapter output of input row `h`."""
    return lora_ref(h.float(), torch.zeros(1, sum(slices)), a, b, [slot], torch.tensor(RANKS, dtype=torch.int32),
                    torch.tensor(SCALINGS), slices)


def _rel(got: torch.Tensor, want: torch.Tensor, base: torch.Tensor) -> float:
    return float((got.float().cpu() - want).norm() / (want - base).norm().clamp_min(1e-12))


@pytest.mark.parametrize("slot", [0, 1, 2])
@pytest.mark.parametrize("k,slices,tiles,config", [
    (100, (40, 16, 16), (3, 32, 1), GemvConfig(4, 32)),  # ragged K over 2 splits; rows of a tile in two slices
    (160, (40, 16, 16), (5, 32, 1), GemvConfig(8, 64)),  # 5 splits: the epilogue's tile of 8 masks 3
    (64, (48,), (1, 64, 1), GemvConfig(8, 64)),
    (96, (24, 24), None, GemvConfig(2, 32))])
def test_plain_gemv_adds_the_row_adapter(slot: int, k: int, slices: tuple[int, ...],
                                         tiles: tuple[int, int, int] | None, config: GemvConfig) -> None:
    x, w = _rand(1, k, seed=1), _rand(sum(slices), k, seed=2, scale=0.1)
    a, b = _slots(k, slices)
    epi = _shrink(x, a, b, slot, slices, tiles)
    got = gemv(x.to(DEVICE), w.to(DEVICE), config=config, lora=epi)
    base = x @ w.t()
    want = base + _delta(x, a, b, slot, slices)
    assert _rel(got, want, base) < 1e-5


@pytest.mark.parametrize("slot", [-1, 3])  # the base model; an empty slot
def test_a_row_without_an_adapter_is_the_plain_gemv(slot: int) -> None:
    k, slices = 64, (24, 8, 8)
    x, w = _rand(1, k, seed=1).to(DEVICE), _rand(sum(slices), k, seed=2, scale=0.1).to(DEVICE)
    a, b = _slots(k, slices)
    epi = _shrink(x, a, b, slot, slices, (2, 32, 1))
    assert torch.equal(epi.xa, torch.zeros_like(epi.xa))
    cfg = GemvConfig(4, 32)
    assert torch.equal(gemv(x, w, config=cfg, lora=epi), gemv(x, w, config=cfg))


def _normed(x: torch.Tensor, residual: torch.Tensor, nw: torch.Tensor) -> torch.Tensor:
    summed = (x + residual).to(x.dtype).float()
    return summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + EPS) * nw.float()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("slot", [0, 1])
def test_norm_gemv_adds_the_adapter_of_the_normed_row(dtype: torch.dtype, tol: float, gated: bool,
                                                      slot: int) -> None:
    """As the same GEMV with the reference adapter output as its addend (both join before rounding and SiLU)."""
    k, n = 80, 48
    slices = (n // 2, n // 2) if gated else (32, 8, 8)
    x, residual = _rand(1, k, seed=1).to(dtype), _rand(1, k, seed=2).to(dtype)
    nw = (1 + _rand(k, seed=3, scale=0.1)).to(dtype)
    w = _rand(n, k, seed=6, scale=0.1).to(dtype)
    a, b = _slots(k, slices)
    a, b = a.to(dtype).float(), b.to(dtype).float()  # the reference reads the values the kernels read
    epi = _shrink(x, a, b, slot, slices, (3, 16, 1), residual, nw)
    delta = _delta(_normed(x, residual, nw), a, b, slot, slices).to(DEVICE)
    args = (x.to(DEVICE), residual.to(DEVICE), nw.to(DEVICE), EPS, w.to(DEVICE))
    cfg = GemvConfig(4, 32)
    got, summed = gemv_add_rmsnorm(*args, gated=gated, config=cfg, lora=epi)
    want, want_summed = gemv_add_rmsnorm(*args, gated=gated, config=cfg, addend=delta)
    plain, _ = gemv_add_rmsnorm(*args, gated=gated, config=cfg)
    assert torch.equal(summed, want_summed)
    assert _rel(got, want.float().cpu(), plain.float().cpu()) < tol


@pytest.mark.parametrize("slot", [0, 2, -1])
def test_qkv_rope_gemv_adds_the_adapter_before_the_rotation_and_the_store(slot: int) -> None:
    hq, hkv, d, k = 4, 2, 16, 64
    slices = (hq * d, hkv * d, hkv * d)
    x, residual = _rand(1, k, seed=1).to(DEVICE), _rand(1, k, seed=2).to(DEVICE)
    nw = (1 + _rand(k, seed=3, scale=0.1)).to(DEVICE)
    w = _rand(sum(slices), k, seed=6, scale=0.1).to(DEVICE)
    a, b = _slots(k, slices, max_rank=16)
    epi = _shrink(x, a, b, slot, slices, (2, 32, 1), residual, nw, ranks=[8, 16, 16, 0])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), inv_freq)
    outs = []
    for lora in (True, False):
        pools = [torch.zeros(5, hkv, d, device=DEVICE) for _ in range(2)]
        rope = RopeStore(torch.tensor([9], device=DEVICE), freqs.cos().to(DEVICE), freqs.sin().to(DEVICE), *pools,
                         torch.tensor([3], device=DEVICE), hq, hkv, d)
        delta = lora_ref(_normed(x.cpu(), residual.cpu(), nw.cpu()), torch.zeros(1, sum(slices)), a, b, [slot],
                         torch.tensor([8, 16, 16, 0], dtype=torch.int32), torch.tensor(SCALINGS), slices)
        qkv, _ = gemv_add_rmsnorm_rope(x, residual, nw, EPS, w, None, rope, config=GemvConfig(4, 32),
                                       **({"lora": epi} if lora else {"addend": delta.to(DEVICE)}))
        outs.append((qkv, *pools))
    for got, want in zip(outs[0], outs[1]):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_shrink_tiles_and_checks() -> None:
    # the default width (64 partial sums a row): rank 16 in 4 splits of >= 1,024 features, 256 a loop step
    assert shrink_tiles(4096, 16, cpu=False) == (4, 256, 4) and shrink_tiles(14336, 16, cpu=False)[0] == 4
    assert shrink_tiles(4096, 64, cpu=False) == (1, 64, 4) and shrink_tiles(4096, 256, cpu=False)[0] == 1
    assert shrink_tiles(14336, 64, cpu=False)[0] == 4  # a long K at a high rank: splits of <= 4,096 features
    assert shrink_tiles(128, 16, cpu=False)[0] == 1 and shrink_tiles(2048, 8, cpu=False) == (2, 512, 4)
    assert shrink_tiles(4096, 16, cpu=False, width=256)[0] == 4
    assert shrink_tiles(16384, 16, cpu=False, width=256)[0] == 16
    assert shrink_tiles(4096, 16, cpu=True) == (4, 32, 1) and shrink_tiles(4096, 16, cpu=True, width=32)[0] == 2
    x = _rand(1, 32, seed=0).to(DEVICE)
    a, b = _slots(32, (8,), max_rank=4)
    with pytest.raises(AssertionError, match="a must be"):
        _shrink(x, a[:, :2], b, 0, (8,), None)
    with pytest.raises(AssertionError, match="norm takes both"):
        _shrink(x, a, b, 0, (8,), None, residual=x)
    epi = _shrink(x, a, b, 0, (8,), None)
    with pytest.raises(AssertionError, match="slices"):
        gemv(x, _rand(9, 32, seed=1).to(DEVICE), lora=epi)
