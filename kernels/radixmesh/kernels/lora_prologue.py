"""A batch-1 LoRA adapter's output with the RMSNorm before it computed in the same kernel, as an addend for the
fused GEMVs (`gemv_fused.gemv_add_rmsnorm`, `gemv_rope.gemv_add_rmsnorm_rope`).

At batch 1 the GEMV runs the residual add and RMSNorm inside its loop, and after it the rotary embedding of
q/k (with the KV store) or SiLU-and-mul: an adapter adds to the projection before that epilogue, and reads
the normed input, which no kernel writes. Adding the adapter after the projection would undo the fusion (a
norm, a rotary and a SiLU launch more per layer, as many as the adapter's own). Instead this kernel computes

    delta = scaling * B @ (A @ (rmsnorm(x + residual) * norm_weight))     float32 `[1, N]`

reading x and the residual itself (the norm's scale, one number per row, is summed along the same K loop and
applied to the rank-r product at the end), and the GEMV adds `delta` to its projection before the epilogue:
one launch per stacked projection, and the base layer's kernels unchanged. A program per output tile of a
slice recomputes its slice's `x @ A.T` (as the fused LoRA kernel does). A row of slot -1, or an empty slot,
gets a zero delta.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import check_device, check_float, next_power_of_2
from radixmesh.kernels._jit import unspecialized
from radixmesh.kernels._pdl import gdc_launch_dependents, gdc_wait, pdl_args
from radixmesh.kernels.lora_grouped import fused_tiles


@triton.jit
def _normed(x_ptr, r_ptr, nw_ptr, cols, K):
    """(squares, h) of one K tile: `s = x + r` rounded to x's dtype (the residual stream, as the GEMV rounds
    it), its squares and `s * nw`, in float32."""
    k_ok = cols < K
    summed = (tl.load(x_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
              + tl.load(r_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
    return summed * summed, summed * tl.load(nw_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)


@triton.jit(**unspecialized(ints=("K",)))
def _norm_delta_kernel(x_ptr, r_ptr, nw_ptr, a_ptr, b_ptr, slots_ptr, ranks_ptr, scalings_ptr, d_ptr, K, eps,
                       n0, n1, n2, tiles_per_slice, stride_as, stride_ar, stride_bs, stride_bn,
                       R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                       PDL: tl.constexpr):
    piece = tl.program_id(0) // tiles_per_slice
    tile = tl.program_id(0) % tiles_per_slice
    size = tl.where(piece == 0, n0, tl.where(piece == 1, n1, n2))
    first_col = tl.where(piece == 0, 0, tl.where(piece == 1, n0, n0 + n1))
    # slots, ranks and A come from host copies, never from a kernel: the first A tile is loaded before waiting
    # for the kernels that write x and the residual (radixmesh.kernels._pdl)
    slot = tl.load(slots_ptr)
    safe_slot = tl.maximum(slot, 0)
    rank = tl.where(slot >= 0, tl.load(ranks_ptr + safe_slot), 0)
    r = tl.arange(0, BLOCK_R)
    r_ok = (r < tl.where(tile * BLOCK_N < size, rank, 0)) & (r < R)  # none for a tile past the slice
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + safe_slot.to(tl.int64) * stride_as + (piece * R + r).to(tl.int64)[None, :] * stride_ar
    at = tl.load(a_rows + offs_k[:, None], mask=(offs_k < K)[:, None] & r_ok[None, :], other=0.0)  # A.T
    if PDL:
        gdc_wait()
    if tile * BLOCK_N >= size:
        return
    sq, h = _normed(x_ptr, r_ptr, nw_ptr, offs_k, K)
    squares = sq
    acc = h[:, None] * at.to(tl.float32)  # [BLOCK_K, BLOCK_R]
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=3):
        cols = k + offs_k
        at = tl.load(a_rows + cols[:, None], mask=(cols < K)[:, None] & r_ok[None, :], other=0.0)
        sq, h = _normed(x_ptr, r_ptr, nw_ptr, cols, K)
        squares += sq
        acc += h[:, None] * at.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
    xa = tl.sum(acc, axis=0) * rstd  # [BLOCK_R]
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < size
    cols_n = first_col + tl.where(n_ok, offs_n, 0)
    b_tile = tl.load(b_ptr + safe_slot.to(tl.int64) * stride_bs + cols_n.to(tl.int64)[:, None] * stride_bn
                     + r[None, :], mask=r_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_R]
    delta = tl.load(scalings_ptr + safe_slot) * tl.sum(b_tile * xa[None, :], axis=1)
    if PDL:
        gdc_launch_dependents()
    tl.store(d_ptr + cols_n, delta, mask=n_ok)


def lora_norm_delta(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, ranks: torch.Tensor,
                    scalings: torch.Tensor, slice_sizes: tuple[int, ...],
                    tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """float32 `[1, sum(slice_sizes)]`: the adapter of `slots[0]` applied to `rmsnorm(x + residual) *
    norm_weight` for one row `x`, `residual` `[1, K]`; slot buffers `a`, `b`, `ranks`, `scalings` as in
    `radixmesh.kernels.lora`; `tiles` (block_k, block_n, num_warps) or the fused launch's defaults."""
    check_float("x", x)
    k = x.shape[-1]
    for name, t in (("x", x), ("residual", residual)):
        check_device(name, t, x.device)
        assert tuple(t.shape) == (1, k) and t.dtype == x.dtype and t.is_contiguous(), (
            f"{name} must be a contiguous [1, {k}] {x.dtype}, got {t.dtype} {tuple(t.shape)}")
    assert tuple(norm_weight.shape) == (k,) and norm_weight.is_contiguous(), f"norm_weight must be [{k}]"
    assert 1 <= len(slice_sizes) <= 3 and min(slice_sizes) >= 1, f"1..3 slices: {slice_sizes}"
    n, max_rank = sum(slice_sizes), b.shape[2]
    assert a.dim() == 3 and tuple(a.shape[1:]) == (len(slice_sizes) * max_rank, k) and a.dtype == x.dtype, (
        f"a must be [slots, {len(slice_sizes) * max_rank}, {k}] {x.dtype}, got {a.dtype} {tuple(a.shape)}")
    assert b.dim() == 3 and b.shape[1] == n and b.dtype == x.dtype and a.shape[0] == b.shape[0], (
        f"b must be [{a.shape[0]}, {n}, R] {x.dtype}, got {b.dtype} {tuple(b.shape)}")
    assert a.is_contiguous() and b.is_contiguous(), "a and b must be contiguous"
    for name, t, dtype in (("slots", slots, torch.int32), ("ranks", ranks, torch.int32),
                           ("scalings", scalings, torch.float32)):
        check_device(name, t, x.device)
        assert t.dtype == dtype and t.dim() == 1 and t.is_contiguous(), f"{name} must be a contiguous {dtype} 1-D"
    assert slots.numel() >= 1 and ranks.shape == scalings.shape == (a.shape[0],), "a slot; a rank per slot"
    block_k, block_n, num_warps = tiles or fused_tiles(1, max_rank, slice_sizes, x.device.type == "cpu")
    delta = torch.empty((1, n), dtype=torch.float32, device=x.device)
    sizes = (*slice_sizes, 0, 0)[:3]
    per_slice = triton.cdiv(max(slice_sizes), block_n)
    _norm_delta_kernel[(len(slice_sizes) * per_slice,)](
        x, residual, norm_weight, a, b, slots, ranks, scalings, delta, k, eps, *sizes, per_slice,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), R=max_rank, BLOCK_R=max(16, next_power_of_2(max_rank)),
        BLOCK_K=block_k, BLOCK_N=block_n, num_warps=num_warps, **pdl_args(x.device))
    return delta
