"""The batch-1 LoRA addend with the RMSNorm before it (`radixmesh.kernels.lora_prologue`) against the reference
on the normed row, under the Triton interpreter without CUDA: mixed ranks below the slots' R, stacked slices,
a base row and an empty slot giving zeros."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.kernels.lora_prologue import lora_norm_delta
from radixmesh.kernels.lora_ref import lora_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-5
MAX_RANK = 32
RANKS = [8, 32, 0]  # slot 2 empty
SCALINGS = [2.0, 0.5, 1.0]


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _case(k: int, slices: tuple[int, ...], slot: int, tiles: tuple[int, int, int] | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    x, residual = _rand(1, k, seed=1), _rand(1, k, seed=2)
    nw = 1.0 + _rand(k, seed=3, scale=0.1)
    a = _rand(len(RANKS), len(slices) * MAX_RANK, k, seed=4, scale=0.1)
    b = _rand(len(RANKS), sum(slices), MAX_RANK, seed=5, scale=0.1)
    for s, rank in enumerate(RANKS):  # junk past each rank: never read
        b[s, :, rank:] = 1e4
        for i in range(len(slices)):
            a[s, i * MAX_RANK + rank:(i + 1) * MAX_RANK] = 1e4
    ranks, scalings = torch.tensor(RANKS, dtype=torch.int32), torch.tensor(SCALINGS)
    summed = x + residual
    h = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + EPS) * nw  # the normed row
    want = lora_ref(h, torch.zeros(1, sum(slices)), a, b, [slot], ranks, scalings, slices)
    got = lora_norm_delta(x.to(DEVICE), residual.to(DEVICE), nw.to(DEVICE), EPS, a.to(DEVICE), b.to(DEVICE),
                          torch.tensor([slot], dtype=torch.int32, device=DEVICE), ranks.to(DEVICE),
                          scalings.to(DEVICE), slices, tiles)
    assert got.dtype == torch.float32 and got.shape == (1, sum(slices))
    return got.cpu(), want


@pytest.mark.parametrize("slot", [0, 1])
@pytest.mark.parametrize("k,slices,tiles", [(100, (40, 16, 16), (32, 16, 1)), (64, (24, 24), (64, 32, 1)),
                                            (48, (20,), None)])
def test_the_addend_is_the_adapter_on_the_normed_row(k: int, slices: tuple[int, ...], slot: int,
                                                     tiles: tuple[int, int, int] | None) -> None:
    got, want = _case(k, slices, slot, tiles)
    assert float((got - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize("slot", [-1, 2])  # the base model; an empty slot
def test_a_row_without_an_adapter_gets_zeros(slot: int) -> None:
    got, _ = _case(64, (24, 8, 8), slot, (32, 16, 1))
    assert torch.equal(got, torch.zeros_like(got))


def test_the_launcher_checks_its_inputs() -> None:
    x = torch.randn(1, 32, device=DEVICE)
    a, b = torch.randn(2, 16, 32, device=DEVICE), torch.randn(2, 8, 16, device=DEVICE)
    slots, ranks = torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.full((2,), 4, dtype=torch.int32,
                                                                                 device=DEVICE)
    scalings = torch.ones(2, device=DEVICE)
    nw = torch.ones(32, device=DEVICE)
    with pytest.raises(AssertionError, match="residual must be"):
        lora_norm_delta(x, torch.randn(1, 31, device=DEVICE), nw, EPS, a, b, slots, ranks, scalings, (8,))
    with pytest.raises(AssertionError, match="b must be"):
        lora_norm_delta(x, x, nw, EPS, a, b, slots, ranks, scalings, (6,))
    with pytest.raises(AssertionError, match="ranks must be"):
        lora_norm_delta(x, x, nw, EPS, a, b, slots, ranks.long(), scalings, (8,))
