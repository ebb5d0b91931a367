"""The batched LoRA kernels compiled on a GPU at the Llama-3.1-8B projections, each decode kernel set (per row,
grouped by slot, fused): against `lora_ref`, and in a CUDA graph whose slots change between replays (skipped
without CUDA)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # skipped then; keep the CPU tests' interpreter mode

import pytest

from radixmesh.kernels.lora import LoraBatch, lora_apply
from radixmesh.kernels.lora_ref import lora_ref, row_slots

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
QKV, GATE_UP, O_PROJ, DOWN = ((4096, (4096, 1024, 1024)), (4096, (14336, 14336)), (4096, (4096,)), (14336, (4096,)))
NUM_SLOTS, MAX_RANK = 16, 64
RANKS = [16] * 12 + [64, 64, 8, 8]  # mixed ranks in one buffer sized for 64


def _adapters(k: int, slices: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=DEVICE).manual_seed(k + len(slices))
    a = torch.randn(NUM_SLOTS, len(slices) * MAX_RANK, k, device=DEVICE, generator=gen, dtype=torch.bfloat16) * 0.02
    b = torch.randn(NUM_SLOTS, sum(slices), MAX_RANK, device=DEVICE, generator=gen, dtype=torch.bfloat16) * 0.02
    ranks = torch.tensor(RANKS, dtype=torch.int32, device=DEVICE)
    scalings = (32.0 / ranks.float()).contiguous()
    return a, b, ranks, scalings


def _check(x: torch.Tensor, slices: tuple[int, ...], batch: LoraBatch, kernels: str = "auto") -> torch.Tensor:
    a, b, ranks, scalings = _adapters(x.shape[1], slices)
    y = torch.randn(x.shape[0], sum(slices), device=DEVICE, dtype=torch.bfloat16)
    got = lora_apply(x, y.clone(), a, b, batch, ranks, scalings, slices, kernels=kernels)
    slots = row_slots(batch.slots.cpu(), None if batch.seg_starts is None else batch.seg_starts.cpu(), x.shape[0])
    want = lora_ref(x, y, a, b, slots, ranks.cpu(), scalings.cpu(), slices)
    base = [row for row, slot in enumerate(slots) if slot < 0]
    assert torch.equal(got[base], y[base]), "base rows changed"
    contribution = (want - y.float()).norm()
    assert contribution > 0, "no row has an adapter: the relative error would be 0 / 0"
    # against the reference rounded to y's dtype: bf16's spacing at |y| ~ 1 alone is ~1% of a rank-16 adapter's
    # contribution of one row, which would leave no margin for the kernels' own error
    err = float((got.float() - want.to(got.dtype).float()).norm() / contribution)
    assert err < 1e-2, f"relative error {err:.3g} of the adapters' contribution"
    return got


@pytest.mark.parametrize("kernels", ["rows", "grouped", "fused"])
@pytest.mark.parametrize("k,slices", [QKV, GATE_UP, O_PROJ, DOWN])
@pytest.mark.parametrize("rows", [1, 4, 32, 256])
def test_decode_rows_over_sixteen_adapters(k: int, slices: tuple[int, ...], rows: int, kernels: str) -> None:
    slots = torch.arange(rows, dtype=torch.int32) % (NUM_SLOTS + 1)
    slots[slots == NUM_SLOTS] = -1  # slots 0..15, then a base row: a batch of one has an adapter
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
    _check(x, slices, LoraBatch.per_row(slots.to(DEVICE)), kernels)


@pytest.mark.parametrize("kernels", ["rows", "grouped", "fused"])
@pytest.mark.parametrize("k,slices", [QKV, DOWN])
def test_a_lone_base_row_is_left_alone(k: int, slices: tuple[int, ...], kernels: str) -> None:
    a, b, ranks, scalings = _adapters(k, slices)
    x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
    y = torch.randn(1, sum(slices), device=DEVICE, dtype=torch.bfloat16)
    got = lora_apply(x, y.clone(), a, b, LoraBatch.per_row(torch.full((1,), -1, dtype=torch.int32, device=DEVICE)),
                     ranks, scalings, slices, kernels=kernels)
    assert torch.equal(got, y)


@pytest.mark.parametrize("k,slices", [QKV, DOWN])
def test_prefill_segments(k: int, slices: tuple[int, ...]) -> None:
    lengths = [300, 1, 700, 50, 129]
    starts = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32).to(DEVICE)
    slots = torch.tensor([3, 12, 0, -1, 14], dtype=torch.int32, device=DEVICE)
    x = torch.randn(sum(lengths), k, device=DEVICE, dtype=torch.bfloat16)
    _check(x, slices, LoraBatch(slots, starts, max(lengths)))


@pytest.mark.parametrize("rows,kernels", [(32, "rows"), (32, "grouped"), (100, "grouped"), (3, "fused")])
def test_decode_replays_in_a_cuda_graph_with_new_slots(rows: int, kernels: str) -> None:
    k, slices = QKV
    a, b, ranks, scalings = _adapters(k, slices)
    slots = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
    batch = LoraBatch.per_row(slots)
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
    y0 = torch.randn(rows, sum(slices), device=DEVICE, dtype=torch.bfloat16)
    y = y0.clone()
    lora_apply(x, y, a, b, batch, ranks, scalings, slices, kernels=kernels)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_apply(x, y, a, b, batch, ranks, scalings, slices, kernels=kernels)
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        slots.copy_(torch.randint(-1, NUM_SLOTS, (rows,), generator=gen, dtype=torch.int32))
        y.copy_(y0)
        graph.replay()
        eager = lora_apply(x, y0.clone(), a, b, LoraBatch.per_row(slots.clone()), ranks, scalings, slices,
                           kernels=kernels)
        assert torch.equal(y, eager)
