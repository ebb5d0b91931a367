"""Batched LoRA kernels (shrink, expand: per row, grouped by slot, fused) vs the row-by-row reference
`lora_ref`, at tiny shapes.

Without CUDA the kernels run under the Triton interpreter (its float32 -> bf16 cast truncates: bf16 cases
get a looser bound than float32 ones).
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.kernels.lora import (
    FUSED_MAX_ROWS,
    LoraBatch,
    LoraConfig,
    choose_kernels,
    default_config,
    kernel_config,
    lora_apply,
    lora_expand,
    lora_shrink,
)
from radixmesh.kernels.lora_ref import lora_ref, row_slots

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MAX_RANK = 64
RANKS = [8, 64, 16, 8]  # per slot: mixed ranks 8 and 64
# alpha / r for slots 0-2, rsLoRA's alpha / sqrt(r) for slot 3
SCALINGS = [16 / 8, 32 / 64, 16 / 16, 16 / math.sqrt(8)]


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _adapters(in_features: int, slices: tuple[int, ...], dtype: torch.dtype, ranks_of: list[int] = RANKS
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot buffers (a, b); rows past each slot's rank hold junk, which the kernels must never read."""
    num_slots = len(ranks_of)
    a = _rand(num_slots, len(slices) * MAX_RANK, in_features, seed=1, scale=0.1)
    b = _rand(num_slots, sum(slices), MAX_RANK, seed=2, scale=0.1)
    for slot, rank in enumerate(ranks_of):
        b[slot, :, rank:] = 1e4
        for i in range(len(slices)):
            a[slot, i * MAX_RANK + rank:(i + 1) * MAX_RANK] = 1e4
    return a.to(dtype), b.to(dtype)


def _run(x: torch.Tensor, y: torch.Tensor, slices: tuple[int, ...], batch: LoraBatch,
         config: LoraConfig | None, kernels: str = "rows", ranks_of: list[int] = RANKS
         ) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _adapters(x.shape[1], slices, x.dtype, ranks_of)
    ranks = torch.tensor(ranks_of, dtype=torch.int32)
    scalings = torch.tensor([*SCALINGS, *[0.75] * len(ranks_of)][:len(ranks_of)], dtype=torch.float32)
    want = lora_ref(x, y, a, b, row_slots(batch.slots.cpu(), None if batch.seg_starts is None else
                                          batch.seg_starts.cpu(), x.shape[0]), ranks, scalings, slices)
    on = LoraBatch(batch.slots.to(DEVICE), None if batch.seg_starts is None else batch.seg_starts.to(DEVICE),
                   batch.max_seg_len)
    got = lora_apply(x.to(DEVICE), y.clone().to(DEVICE), a.to(DEVICE), b.to(DEVICE), on, ranks.to(DEVICE),
                     scalings.to(DEVICE), slices, config, kernels=kernels)
    return got.cpu(), want


def _rel_err(got: torch.Tensor, want: torch.Tensor, y: torch.Tensor) -> float:
    """Error relative to the adapters' contribution (not to y, which would hide it); some row must have one."""
    contribution = (want - y.float()).norm()
    assert contribution > 0, "no row has an adapter: the relative error would be 0 / 0"
    return float((got.float() - want).norm() / contribution)


I32 = torch.int32


DECODE_KERNELS = [  # (kernel set, tiles): rows; grouped with K split 1 or 3 ways; fused with K and N steps
    ("rows", LoraConfig(1, 32, 16, 1, 1)), ("rows", LoraConfig(1, 16, 32, 3, 1)),
    ("grouped", LoraConfig(16, 32, 16, 1, 1)), ("grouped", LoraConfig(16, 16, 32, 3, 1)),
    ("fused", LoraConfig(1, 32, 16, 1, 1)), ("fused", LoraConfig(1, 64, 32, 1, 1)),
]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("kernels,config", DECODE_KERNELS)
def test_decode_rows_with_mixed_adapters_and_qkv_slices(dtype: torch.dtype, tol: float, kernels: str,
                                                        config: LoraConfig) -> None:
    slots = torch.tensor([0, -1, 1, 3, 1, 2, -1], dtype=I32)  # base rows, two rows sharing slot 1
    x, y = _rand(7, 96, seed=3).to(dtype), _rand(7, 48 + 16 + 16, seed=4).to(dtype)
    got, want = _run(x, y, (48, 16, 16), LoraBatch.per_row(slots), config, kernels)
    assert _rel_err(got, want, y) < tol
    for row in (1, 6):  # base rows: untouched, bit for bit
        assert torch.equal(got[row], y[row])


@pytest.mark.parametrize("slices,config", [
    ((40, 40), LoraConfig(16, 32, 16, 1, 1)),  # gate/up: two B's into one output
    ((24,), LoraConfig(16, 16, 32, 2, 1)),
])
def test_prefill_segments_of_different_lengths(slices: tuple[int, ...], config: LoraConfig) -> None:
    seg_starts = torch.tensor([0, 5, 6, 30, 30, 41], dtype=I32)  # 5 rows, 1, 24, an empty one, 11
    slots = torch.tensor([1, 0, -1, 2, 3], dtype=I32)
    x, y = _rand(41, 64, seed=5), _rand(41, sum(slices), seed=6)
    got, want = _run(x, y, slices, LoraBatch(slots, seg_starts, 24), config)
    assert _rel_err(got, want, y) < 1e-5
    assert torch.equal(got[6:30], y[6:30])


@pytest.mark.parametrize("in_features,slices", [(4096, (32, 16, 16)), (14336, (32,))])
@pytest.mark.parametrize("slot", [0, 1, -1])
def test_a_batch_of_one_row_with_the_gpu_tiles(in_features: int, slices: tuple[int, ...], slot: int) -> None:
    batch = LoraBatch.per_row(torch.tensor([slot], dtype=I32))
    config = default_config(batch, in_features, len(slices), torch.device("cuda"))
    assert config.num_splits == min(16, in_features // 512)  # batch 1: K split over 8 (4096) or 16 programs
    x, y = _rand(1, in_features, seed=10, scale=0.1), _rand(1, sum(slices), seed=11)
    got, want = _run(x, y, slices, batch, config, "rows")
    if slot < 0:
        assert torch.equal(got, y)
    else:
        assert _rel_err(got, want, y) < 1e-5


@pytest.mark.parametrize("kernels", ["rows", "grouped", "fused"])
def test_a_batch_of_base_rows_is_left_alone(kernels: str) -> None:
    x, y = _rand(4, 32, seed=7), _rand(4, 16, seed=8)
    got, _ = _run(x, y, (16,), LoraBatch.per_row(torch.full((4,), -1, dtype=I32)), None, kernels)
    assert torch.equal(got, y)


def test_shrink_and_expand_by_themselves() -> None:
    x = _rand(3, 64, seed=9).to(DEVICE)
    a, b = (t.to(DEVICE) for t in _adapters(64, (32,), torch.float32))
    batch = LoraBatch.per_row(torch.tensor([2, 0, 2], dtype=I32, device=DEVICE))
    ranks = torch.tensor(RANKS, dtype=I32, device=DEVICE)
    xa = lora_shrink(x, a, batch, ranks, config=LoraConfig(1, 16, 16, 2, 1))
    assert xa.shape == (2, 3, MAX_RANK)
    want = torch.stack([a[2, :16].cpu() @ x[row].cpu() for row in (0, 2)])  # slot 2 has rank 16
    torch.testing.assert_close(xa.sum(0)[[0, 2], :16].cpu(), want, rtol=1e-5, atol=1e-5)
    y = torch.zeros(3, 32, device=DEVICE)
    lora_expand(xa, b, batch, ranks, torch.ones(4, device=DEVICE), y, (32,), LoraConfig(1, 16, 16, 2, 1))
    torch.testing.assert_close(y[1].cpu(), b[0, :, :8].cpu() @ xa.sum(0)[1, :8].cpu(), rtol=1e-5, atol=1e-5)


def test_launchers_check_their_inputs() -> None:
    x, y = torch.randn(3, 32, device=DEVICE), torch.randn(3, 16, device=DEVICE)
    a, b = torch.randn(4, 16, 32, device=DEVICE), torch.randn(4, 16, 16, device=DEVICE)
    ranks = torch.tensor([16, 8, 8, 8], dtype=I32, device=DEVICE)
    scalings = torch.ones(4, device=DEVICE)
    batch = LoraBatch.per_row(torch.tensor([0, 1, -1], dtype=I32, device=DEVICE))
    with pytest.raises(AssertionError, match="slots for 3 rows"):
        lora_apply(x, y, a, b, LoraBatch.per_row(batch.slots[:2]), ranks, scalings, (16,))
    with pytest.raises(AssertionError, match="must cover"):
        lora_apply(x, y, a, b, batch, ranks, scalings, (8, 4))
    with pytest.raises(AssertionError, match="a is"):
        lora_apply(x, y, a.bfloat16(), b, batch, ranks, scalings, (16,))
    with pytest.raises(AssertionError, match="not a multiple"):
        lora_shrink(x, a, batch, ranks, num_slices=3)
    with pytest.raises(AssertionError, match="contiguous int32"):
        lora_apply(x, y, a, b, LoraBatch.per_row(batch.slots.long()), ranks, scalings, (16,))
    with pytest.raises(AssertionError, match="seg_starts must be"):
        lora_apply(x, y, a, b, LoraBatch(batch.slots, batch.slots, 2), ranks, scalings, (16,))


def test_default_configs() -> None:
    gpu = torch.device("cuda")
    decode = default_config(LoraBatch.per_row(torch.zeros(32, dtype=I32)), 4096, 3, gpu)
    single = default_config(LoraBatch.per_row(torch.zeros(1, dtype=I32)), 4096, 3, gpu)
    prefill = default_config(LoraBatch(torch.zeros(4, dtype=I32), torch.zeros(5, dtype=I32), 1000), 4096, 1, gpu)
    assert decode.block_m == 1 and single.num_splits > decode.num_splits >= 1
    assert prefill.block_m == 64 and prefill.num_splits == 4  # 64 programs: K split 4 ways


# ---- the grouped and fused decode kernels --------------------------------------------------------------------
RANKS_WITH_EMPTY = [*RANKS, 0, 32]  # slot 4 empty (rank 0: its rows add nothing), slot 5 rank 32 of R 64


@pytest.mark.parametrize("config", [LoraConfig(16, 32, 16, 1, 1), LoraConfig(16, 16, 32, 4, 1),
                                    LoraConfig(32, 32, 16, 2, 1)])
def test_grouped_rows_of_one_slot_spread_over_several_row_blocks(config: LoraConfig) -> None:
    gen = torch.Generator().manual_seed(12)
    slots = torch.randint(-1, len(RANKS_WITH_EMPTY), (40,), generator=gen, dtype=I32)  # 40 rows: 3 blocks of 16
    slots[:3] = torch.tensor([1, 1, -1], dtype=I32)
    x, y = _rand(40, 72, seed=13), _rand(40, 24 + 8 + 8, seed=14)  # K=72: a partial K step and split
    got, want = _run(x, y, (24, 8, 8), LoraBatch.per_row(slots), config, "grouped", RANKS_WITH_EMPTY)
    assert _rel_err(got, want, y) < 1e-5
    for row in [r for r, s in enumerate(slots.tolist()) if s in (-1, 4)]:  # base rows and the empty slot's
        assert torch.equal(got[row], y[row])


@pytest.mark.parametrize("rows", list(range(1, FUSED_MAX_ROWS + 1)))
@pytest.mark.parametrize("config", [LoraConfig(1, 32, 16, 1, 1), LoraConfig(1, 128, 64, 1, 1)])
def test_fused_rows_up_to_the_threshold(rows: int, config: LoraConfig) -> None:
    slots = torch.tensor([5, 2, -1, 0][:rows], dtype=I32)  # rank 32 of R 64 first: a batch of one has an adapter
    x, y = _rand(rows, 100, seed=15), _rand(rows, 40 + 24 + 24, seed=16)  # K, N not multiples of the tiles
    got, want = _run(x, y, (40, 24, 24), LoraBatch.per_row(slots), config, "fused", RANKS_WITH_EMPTY)
    assert _rel_err(got, want, y) < 1e-5
    if rows >= 3:
        assert torch.equal(got[2], y[2])


@pytest.mark.parametrize("kernels", ["rows", "grouped", "fused"])
def test_the_kernel_sets_agree_in_bf16(kernels: str) -> None:
    slots = torch.tensor([3, 0, 5, -1, 0, 1], dtype=I32)
    x, y = _rand(6, 64, seed=17, scale=0.5).bfloat16(), _rand(6, 32 + 32, seed=18).bfloat16()
    got, want = _run(x, y, (32, 32), LoraBatch.per_row(slots), None, kernels, RANKS_WITH_EMPTY)
    assert _rel_err(got, want, y) < 3e-2
    assert torch.equal(got[3], y[3])


def test_grouped_shrink_writes_only_rows_with_an_adapter() -> None:
    x = _rand(20, 48, seed=19).to(DEVICE)
    a, _ = (t.to(DEVICE) for t in _adapters(48, (16,), torch.float32))
    slots = torch.tensor([2, -1, 0] + [-1] * 16 + [2], dtype=I32, device=DEVICE)
    ranks = torch.tensor(RANKS, dtype=I32, device=DEVICE)
    out = torch.full((2, 20, MAX_RANK), float("nan"), device=DEVICE)
    lora_shrink(x, a, LoraBatch.per_row(slots), ranks, 1, out, LoraConfig(16, 16, 16, 2, 1), "grouped")
    assert torch.isnan(out[:, 1]).all() and torch.isnan(out[:, 3:19]).all()
    want = torch.stack([a[2, :16].cpu() @ x[row].cpu() for row in (0, 19)])  # slot 2 has rank 16
    torch.testing.assert_close(out.sum(0)[[0, 19], :16].cpu(), want, rtol=1e-5, atol=1e-5)


def test_auto_takes_the_per_row_launches_and_rows_for_segments() -> None:
    def per_row(n: int) -> LoraBatch:
        return LoraBatch.per_row(torch.zeros(n, dtype=I32))

    for rows, rank in ((1, 16), (FUSED_MAX_ROWS, 64), (FUSED_MAX_ROWS + 1, 16), (32, 128)):
        assert choose_kernels("auto", per_row(rows), rank) == "rows"  # the fastest on an H200 (docs)
    assert choose_kernels("grouped", per_row(1), 16) == "grouped"
    assert choose_kernels("rows", per_row(1), 16) == "rows"
    assert choose_kernels("fused", per_row(64), 16) == "fused"
    segments = LoraBatch(torch.zeros(2, dtype=I32), torch.tensor([0, 3, 5], dtype=I32), 3)
    assert choose_kernels("grouped", segments, 16) == "rows"
    with pytest.raises(AssertionError, match="kernels must be one of"):
        choose_kernels("punica", per_row(1), 16)


def test_grouped_and_fused_tiles_on_the_gpu() -> None:
    gpu = torch.device("cuda")
    decode = kernel_config("grouped", LoraBatch.per_row(torch.zeros(32, dtype=I32)), 4096, (4096, 1024, 1024), 16,
                           16, gpu)
    assert (decode.block_m, decode.num_splits) == (32, 5)  # 16 slots x 3 slices x 5 splits: about 2 per SM
    big = kernel_config("grouped", LoraBatch.per_row(torch.zeros(256, dtype=I32)), 14336, (4096,), 16, 16, gpu)
    assert big.block_m == 64 and big.num_splits == 4
    one = kernel_config("fused", LoraBatch.per_row(torch.zeros(1, dtype=I32)), 4096, (4096, 1024, 1024), 16, 1, gpu)
    assert (one.block_k, one.block_n) == (512, 128)  # 3 slices x 32 tiles: one wave
    wide = kernel_config("fused", LoraBatch.per_row(torch.zeros(1, dtype=I32)), 4096, (14336, 14336), 64, 1, gpu)
    assert (wide.block_k, wide.block_n) == (128, 128)  # R 64: tiles of 8192 values


def test_grouped_launchers_check_their_inputs() -> None:
    x, y = torch.randn(3, 32, device=DEVICE), torch.randn(3, 16, device=DEVICE)
    a = torch.randn(4, 16, 32, device=DEVICE)
    ranks = torch.tensor([16, 8, 8, 8], dtype=I32, device=DEVICE)
    batch = LoraBatch.per_row(torch.tensor([0, 1, -1], dtype=I32, device=DEVICE))
    segments = LoraBatch(batch.slots, torch.tensor([0, 1, 2, 3], dtype=I32, device=DEVICE), 1)
    with pytest.raises(AssertionError, match="one slot per row"):
        lora_shrink(x, a, segments, ranks, kernels="grouped")
    with pytest.raises(AssertionError, match="16\\+ rows"):
        lora_shrink(x, a, batch, ranks, config=LoraConfig(8, 16, 16), kernels="grouped")
    with pytest.raises(AssertionError, match="rows or grouped"):
        lora_shrink(x, a, batch, ranks, kernels="fused")
    with pytest.raises(AssertionError, match="must cover"):
        lora_apply(x, y, a, torch.randn(4, 16, 16, device=DEVICE), batch, ranks, torch.ones(4, device=DEVICE),
                   (8, 4), kernels="fused")
