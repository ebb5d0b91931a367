"""Row-wise argmax of logits `[batch, vocab]`: greedy sampling's one kernel.

PyTorch reduces each row in one block, so a batch-1 argmax over a 128K vocabulary runs on one
SM (~28 us on an H100, as long as several decoder layers). Here each row is cut into chunks
reduced in parallel (stage 1), then each row's chunk winners are reduced (stage 2). Ties go to
the lowest index, as `torch.argmax` does; rows are expected to hold no NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import check_device, check_float, check_last_dim_contiguous, next_power_of_2

_BLOCK = 2048  # elements a stage-1 program reads per loop iteration
_TARGET_PROGRAMS = 264  # ~2 per SM of an H100: enough chunks to spread one row over the chip


@triton.jit
def _argmax_chunks_kernel(
    logits_ptr, part_val_ptr, part_idx_ptr,
    stride_row, vocab, chunk_len, num_chunks,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    lo = chunk * chunk_len
    hi = tl.minimum(lo + chunk_len, vocab)
    best_val = tl.full([], float("-inf"), dtype=tl.float32)
    best_idx = tl.full([], 2147483647, dtype=tl.int32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * stride_row + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        val, pos = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        idx = (start + pos).to(tl.int32)
        better = (val > best_val) | ((val == best_val) & (idx < best_idx))
        best_val = tl.where(better, val, best_val)
        best_idx = tl.where(better, idx, best_idx)
    out = row * num_chunks + chunk
    tl.store(part_val_ptr + out, best_val)
    tl.store(part_idx_ptr + out, tl.minimum(best_idx, vocab - 1))  # an all -inf chunk: any index of it


@triton.jit
def _argmax_rows_kernel(part_val_ptr, part_idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    vals = tl.load(part_val_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
    idxs = tl.load(part_idx_ptr + row * num_chunks + offs, mask=mask, other=2147483647)
    best = tl.max(vals, axis=0)
    # chunks are in index order, so the lowest index among the maxima is the first occurrence
    winner = tl.min(tl.where(mask & (vals == best), idxs, 2147483647), axis=0)
    winner = tl.where(winner == 2147483647, 0, winner)  # a row of -inf only: index 0, like torch
    tl.store(out_ptr + row, winner.to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(logits, dim=-1)` for `[batch, vocab]` float logits: int64 `[batch]`, no host sync."""
    check_device("logits", logits, logits.device)
    assert logits.dim() == 2, f"logits must be [batch, vocab], got shape {tuple(logits.shape)}"
    check_float("logits", logits)
    check_last_dim_contiguous("logits", logits)
    batch, vocab = logits.shape
    assert 0 < vocab < 2**31 - 1, f"vocab of {vocab} entries is out of range"
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    max_chunks = triton.cdiv(vocab, _BLOCK)
    num_chunks = max(1, min(max_chunks, triton.cdiv(_TARGET_PROGRAMS, batch), 1024))
    chunk_len = triton.cdiv(triton.cdiv(vocab, num_chunks), _BLOCK) * _BLOCK
    num_chunks = triton.cdiv(vocab, chunk_len)
    part_val = torch.empty(batch * num_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(batch * num_chunks, dtype=torch.int32, device=logits.device)
    _argmax_chunks_kernel[(batch, num_chunks)](
        logits, part_val, part_idx, logits.stride(0), vocab, chunk_len, num_chunks, BLOCK=_BLOCK,
    )
    _argmax_rows_kernel[(batch,)](part_val, part_idx, out, num_chunks, BLOCK_C=next_power_of_2(num_chunks))
    return out
