"""Decode-step LoRA launches that read each adapter's weights once: grouped by slot, or fused for a few rows.

The per-row launches of `radixmesh.kernels.lora` give every row its own programs, so rows sharing an adapter
each read its A and B (32 rows over 16 adapters read every adapter twice), and a row's products are summed
in registers. Here instead:

- grouped (any number of rows): a program per (slot, block of rows, ...) takes the rows of the block whose
  slot is its own (a mask from comparing the per-row slots, so no sort and nothing the host must know: a
  CUDA graph replays it for any mix) and multiplies them by its A (shrink) or B (expand) tile on the tensor
  cores: each adapter's weights are read once per block of up to 64 rows. Slots no row uses, or empty
  (rank 0), end at once. The shrink splits K over programs as before; the expand adds the partial sums.
- fused (a few rows): one launch per projection; a program per (row, output tile) computes its row's
  `x @ A.T` over the whole of K (rank <= 64: a few hundred KB from L2, shared by the row's programs), then
  adds `scaling * xa @ B_tile.T` to its columns of `y`. Half the launches of shrink + expand, no `xa` in
  memory; for one row the launches, not the bytes, are the cost.

Layouts, the slot -1 rule and the rank rule are those of `radixmesh.kernels.lora`; the reference is `lora_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import next_power_of_2
from radixmesh.kernels._jit import unspecialized
from radixmesh.kernels._pdl import gdc_launch_dependents, gdc_wait, pdl_args
from radixmesh.kernels._tiles import mma

GROUPED_MAX_BLOCK_M = 64
"""Rows a grouped program scans for its slot (more rows: more blocks, each adapter read once per block)."""
TARGET_PROGRAMS = 264
"""About two programs per SM of an H100/H200 (132 SMs): the grouped shrink splits K until this many run."""
FUSED_TILE_ELEMS = 8192
"""A fused program's A tile (`block_k * R` elements): its registers, and what one K step loads."""


def grouped_tiles(rows: int, num_slots: int, in_features: int, num_slices: int, cpu: bool
                  ) -> tuple[int, int, int, int, int]:
    """(block_m, block_k, block_n, num_splits, num_warps) of the grouped launches; an expand program's float32
    `[block_m, block_n]` tile stays at 8192 values (64 registers a thread in 4 warps)."""
    block_m = min(GROUPED_MAX_BLOCK_M, max(16, next_power_of_2(rows)))
    if cpu:
        return block_m, 32, 16, 2 if in_features >= 64 else 1, 1
    programs = min(num_slots, rows) * triton.cdiv(rows, block_m) * num_slices
    splits = max(1, min(16, TARGET_PROGRAMS // max(1, programs), in_features // 256))
    return block_m, 128, min(256, 8192 // block_m), splits, 4


def fused_tiles(rows: int, max_rank: int, slice_sizes: tuple[int, ...], cpu: bool) -> tuple[int, int, int]:
    """(block_k, block_n, num_warps) of the fused launch: one wave of programs where the outputs allow, the A
    and B tiles of `FUSED_TILE_ELEMS` values at most."""
    block_r = max(16, next_power_of_2(max_rank))
    if cpu:
        return 32, 16, 1
    block_n = 64
    while rows * len(slice_sizes) * triton.cdiv(max(slice_sizes), block_n) > 128 and block_n < 512:
        block_n *= 2
    return max(32, FUSED_TILE_ELEMS // block_r), max(16, min(block_n, FUSED_TILE_ELEMS // block_r)), 8


@triton.jit
def _my_rows(slots_ptr, ranks_ptr, M, slot, BLOCK_M: tl.constexpr):
    """(rows of this block, which of them use `slot`, whether none does or the slot is empty, the slot's rank)."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_batch = rows < M
    mine = (tl.load(slots_ptr + rows, mask=in_batch, other=-1) == slot) & in_batch
    rank = tl.load(ranks_ptr + slot)
    skip = (tl.max(mine.to(tl.int32), axis=0) == 0) | (rank <= 0)
    return tl.where(in_batch, rows, 0), mine, skip, rank


@triton.jit(**unspecialized(ints=("M", "K")))
def _grouped_shrink_kernel(x_ptr, a_ptr, slots_ptr, ranks_ptr, xa_ptr, M, K, k_per_split, num_splits,
                           stride_x, stride_as, stride_ar, stride_split, stride_xa,
                           R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                           DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    slot = tl.program_id(0)
    piece = tl.program_id(2) // num_splits  # the slice (q, k, v ...)
    split = tl.program_id(2) % num_splits
    if PDL:
        gdc_wait()
    rows, mine, skip, rank = _my_rows(slots_ptr, ranks_ptr, M, slot, BLOCK_M)
    if skip:
        return
    r = tl.arange(0, BLOCK_R)
    r_ok = (r < rank) & (r < R)
    offs_k = tl.arange(0, BLOCK_K)
    k0 = split * k_per_split
    k_end = tl.minimum(K, k0 + k_per_split)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + (k0 + offs_k)[None, :]  # [BLOCK_M, BLOCK_K]
    a_ptrs = (a_ptr + slot.to(tl.int64) * stride_as + (piece * R + r).to(tl.int64)[None, :] * stride_ar
              + (k0 + offs_k)[:, None])  # [BLOCK_K, BLOCK_R]: A.T, read once for all the block's rows of the slot
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(k0, k_end, BLOCK_K):
        k_ok = (k + offs_k) < k_end
        xt = tl.load(x_ptrs, mask=mine[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_ptrs, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc = mma(xt, at, acc, True, False, DOT_DTYPE, PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    if PDL:
        gdc_launch_dependents()
    out = xa_ptr + split * stride_split + rows.to(tl.int64)[:, None] * stride_xa + (piece * R + r)[None, :]
    tl.store(out, acc, mask=mine[:, None] & (r < R)[None, :])


@triton.jit(**unspecialized(ints=("M",)))
def _grouped_expand_kernel(xa_ptr, b_ptr, slots_ptr, ranks_ptr, scalings_ptr, y_ptr, M, n0, n1, n2, num_splits,
                           tiles_per_slice, stride_split, stride_xa, stride_bs, stride_bn, stride_y,
                           R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                           PRECISION: tl.constexpr, PDL: tl.constexpr):
    slot = tl.program_id(0)
    piece = tl.program_id(2) // tiles_per_slice
    tile = tl.program_id(2) % tiles_per_slice
    size = tl.where(piece == 0, n0, tl.where(piece == 1, n1, n2))
    first_col = tl.where(piece == 0, 0, tl.where(piece == 1, n0, n0 + n1))
    if PDL:
        gdc_wait()
    rows, mine, skip, rank = _my_rows(slots_ptr, ranks_ptr, M, slot, BLOCK_M)
    if skip | (tile * BLOCK_N >= size):
        return
    r = tl.arange(0, BLOCK_R)
    r_ok = (r < rank) & (r < R)
    xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    xa_ptrs = xa_ptr + rows.to(tl.int64)[:, None] * stride_xa + (piece * R + r)[None, :]
    for split in range(num_splits):  # the shrink's partial sums over K
        xa += tl.load(xa_ptrs + split * stride_split, mask=mine[:, None] & r_ok[None, :], other=0.0)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < size
    cols = first_col + tl.where(n_ok, offs_n, 0)
    bt = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + cols.to(tl.int64)[None, :] * stride_bn + r[:, None],
                 mask=r_ok[:, None], other=0.0)  # [BLOCK_R, BLOCK_N]: B.T, read once for the block's rows
    acc = mma(xa, bt.to(tl.float32), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), True, False, tl.float32,
              PRECISION)
    if PDL:
        gdc_launch_dependents()
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
    mask = mine[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32) + tl.load(scalings_ptr + slot) * acc
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(**unspecialized(ints=("K",)))
def _fused_kernel(x_ptr, a_ptr, b_ptr, slots_ptr, ranks_ptr, scalings_ptr, y_ptr, K, n0, n1, n2, tiles_per_slice,
                  stride_x, stride_as, stride_ar, stride_bs, stride_bn, stride_y,
                  R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                  PDL: tl.constexpr):
    row = tl.program_id(0)
    piece = tl.program_id(1) // tiles_per_slice
    tile = tl.program_id(1) % tiles_per_slice
    size = tl.where(piece == 0, n0, tl.where(piece == 1, n1, n2))
    first_col = tl.where(piece == 0, 0, tl.where(piece == 1, n0, n0 + n1))
    # slots, ranks and A come from host copies, never from a kernel: the first A tile is loaded before waiting
    # for the kernel that writes x (radixmesh.kernels._pdl)
    slot = tl.load(slots_ptr + row)
    safe_slot = tl.maximum(slot, 0)
    rank = tl.where(slot >= 0, tl.load(ranks_ptr + safe_slot), 0)
    skip = (rank <= 0) | (tile * BLOCK_N >= size)
    r = tl.arange(0, BLOCK_R)
    r_ok = (r < tl.where(skip, 0, rank)) & (r < R)  # none when skipped
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + safe_slot.to(tl.int64) * stride_as + (piece * R + r).to(tl.int64)[None, :] * stride_ar
    at = tl.load(a_rows + offs_k[:, None], mask=(offs_k < K)[:, None] & r_ok[None, :], other=0.0)  # A.T
    if PDL:
        gdc_wait()
    if skip:
        return
    x_row = x_ptr + row.to(tl.int64) * stride_x
    xv = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    acc = xv[:, None] * at.to(tl.float32)  # [BLOCK_K, BLOCK_R]: products summed over K once, after the loop
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=3):
        cols = k + offs_k
        k_ok = cols < K
        at = tl.load(a_rows + cols[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        xv = tl.load(x_row + cols, mask=k_ok, other=0.0).to(tl.float32)
        acc += xv[:, None] * at.to(tl.float32)
    xa = tl.sum(acc, axis=0)  # [BLOCK_R]
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < size
    cols = first_col + tl.where(n_ok, offs_n, 0)
    b_tile = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + cols.to(tl.int64)[:, None] * stride_bn + r[None, :],
                     mask=r_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_R]
    delta = tl.sum(b_tile * xa[None, :], axis=1)  # [BLOCK_N]
    if PDL:
        gdc_launch_dependents()
    y_ptrs = y_ptr + row.to(tl.int64) * stride_y + cols
    y = tl.load(y_ptrs, mask=n_ok, other=0.0).to(tl.float32) + tl.load(scalings_ptr + slot) * delta
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def grouped_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, ranks: torch.Tensor, num_slices: int,
                   out: torch.Tensor, block_m: int, block_k: int, num_splits: int, num_warps: int,
                   dot_dtype: tl.dtype, precision: str, pdl: bool = True) -> None:
    """Grouped `x @ A.T` partial sums into `out` `[num_splits, M, num_slices * R]` (inputs checked by the caller;
    `pdl`: the launch may take PDL)."""
    rows, k = x.shape
    max_rank = a.shape[1] // num_slices
    k_per_split = triton.cdiv(triton.cdiv(k, num_splits), block_k) * block_k
    grid = (ranks.shape[0], triton.cdiv(rows, block_m), num_slices * num_splits)
    _grouped_shrink_kernel[grid](
        x, a, slots, ranks, out, rows, k, k_per_split, num_splits, x.stride(0), a.stride(0), a.stride(1),
        out.stride(0), out.stride(1), R=max_rank, BLOCK_M=block_m, BLOCK_R=max(16, next_power_of_2(max_rank)),
        BLOCK_K=block_k, DOT_DTYPE=dot_dtype, PRECISION=precision, num_warps=num_warps, **pdl_args(x.device, pdl))


def grouped_expand(xa: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, ranks: torch.Tensor,
                   scalings: torch.Tensor, y: torch.Tensor, slice_sizes: tuple[int, ...], block_m: int,
                   block_n: int, num_warps: int, pdl: bool = True) -> None:
    """Grouped `y[:, cols_i] += scaling * xa_i @ B_i.T` in place (inputs checked by the caller; `pdl`: the launch
    may take PDL)."""
    rows = y.shape[0]
    max_rank = b.shape[2]
    sizes = (*slice_sizes, 0, 0)[:3]
    tiles = triton.cdiv(max(slice_sizes), block_n)
    grid = (ranks.shape[0], triton.cdiv(rows, block_m), len(slice_sizes) * tiles)
    _grouped_expand_kernel[grid](
        xa, b, slots, ranks, scalings, y, rows, *sizes, xa.shape[0], tiles, xa.stride(0), xa.stride(1),
        b.stride(0), b.stride(1), y.stride(0), R=max_rank, BLOCK_M=block_m,
        BLOCK_R=max(16, next_power_of_2(max_rank)), BLOCK_N=block_n,
        PRECISION="ieee" if y.device.type == "cpu" or y.dtype == torch.float32 else "tf32", num_warps=num_warps,
        **pdl_args(y.device, pdl))


def fused_apply(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                ranks: torch.Tensor, scalings: torch.Tensor, slice_sizes: tuple[int, ...], block_k: int,
                block_n: int, num_warps: int) -> None:
    """Shrink and expand in one launch, a program per (row, output tile) (inputs checked by the caller)."""
    rows, k = x.shape
    max_rank = b.shape[2]
    sizes = (*slice_sizes, 0, 0)[:3]
    tiles = triton.cdiv(max(slice_sizes), block_n)
    _fused_kernel[(rows, len(slice_sizes) * tiles)](
        x, a, b, slots, ranks, scalings, y, k, *sizes, tiles, x.stride(0), a.stride(0), a.stride(1), b.stride(0),
        b.stride(1), y.stride(0), R=max_rank, BLOCK_R=max(16, next_power_of_2(max_rank)), BLOCK_K=block_k,
        BLOCK_N=block_n, num_warps=num_warps, **pdl_args(x.device))
