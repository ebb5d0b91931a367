"""Batched LoRA in plain PyTorch, row by row: the reference of the `lora` kernels.

Adapters sit in slot buffers: `a` `[num_slots, num_slices * R, in]` (slice i's A in rows `i*R .. i*R + rank`)
and `b` `[num_slots, sum(slice_sizes), R]` (slice i's B in the rows of its output columns). A row with slot
`s >= 0` gets, for each slice i, `y[:, cols_i] += scaling[s] * (x @ A_i.T) @ B_i.T` over the first
`ranks[s]` ranks; a row with slot -1 (the base model) is left alone. Float32 throughout.
"""

from __future__ import annotations

import torch


def row_slots(slots: torch.Tensor, seg_starts: torch.Tensor | None, num_rows: int) -> list[int]:
    """Each row's slot: `slots` per row (no `seg_starts`), or per segment of rows `seg_starts[i] ..
    seg_starts[i+1] - 1`; rows past the last segment use none (-1)."""
    per = slots.tolist()
    if seg_starts is None:
        return per
    out = [-1] * num_rows
    starts = seg_starts.tolist()
    for i, slot in enumerate(per):
        for row in range(starts[i], starts[i + 1]):
            out[row] = slot
    return out


def lora_ref(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots_per_row: list[int],
             ranks: torch.Tensor, scalings: torch.Tensor, slice_sizes: tuple[int, ...]) -> torch.Tensor:
    """`y` (float32 copy) plus every row's adapter output; `x` `[M, in]`, `y` `[M, sum(slice_sizes)]`."""
    max_rank = b.shape[2]
    out = y.float().clone()
    for row, slot in enumerate(slots_per_row):
        if slot < 0:
            continue
        rank = int(ranks[slot])
        col = 0
        for i, size in enumerate(slice_sizes):
            xa = a[slot, i * max_rank:i * max_rank + rank].float() @ x[row].float()  # [rank]
            out[row, col:col + size] += float(scalings[slot]) * (b[slot, col:col + size, :rank].float() @ xa)
            col += size
    return out
