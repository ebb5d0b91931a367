"""A batch-1 LoRA adapter inside the base projection's GEMV: one shrink launch per layer input, the expand in the
GEMV's epilogue (the "epilogue" decode kernel set of `radixmesh.kernels.lora`).

At batch 1 a projection's LoRA work is a few KB against the GEMV's MB of weights, so its cost is launches: a
shrink and an expand per projection, and worse, an adapter added after the projection undoes the fused GEMVs
(the norm, the rotary embedding and SiLU-and-mul back in launches of their own). Here

    shrink (one launch per layer input)   xa[split, 0, i*R + r] = sum_{k in split} h[k] * A_i[slot, r, k]
    GEMV epilogue (no launch)             y[n] += scaling[slot] * rstd * sum_r xa[:, 0, i(n)*R + r] * B[slot, n, r]

where `h` is the projection's input: x itself, or `(x + residual) * norm_weight` (rounded as the fused GEMV
rounds it) for a projection whose GEMV runs the RMSNorm, whose scale `rstd` that GEMV computes anyway and
applies to the adapter's term too (so the shrink needs no whole-row reduction before its loop). `i(n)` is the
slice of output row n (q/k/v stacked: three; gate/up: two). The shrink splits K over programs and leaves its
partial sums for the epilogue to add: each GEMV program loads its rows' partials of every split in one tile
(`[BLOCK_N, splits * R]`, from L2, all loads in flight at once rather than a loop of dependent ones), so splits
times R is kept small (`EPILOGUE_WIDTH`). A row's B values are R contiguous numbers next to its K weights: the
epilogue reads ~R/K more bytes than the GEMV.

Rows of slot -1 and empty slots (rank 0) read nothing and add 0; ranks below R read their ranks only. The slot,
ranks and A come from host copies, never from a kernel, so the shrink loads its first A tile before waiting
for the kernel that writes x (radixmesh.kernels._pdl).

With PDL the shrink does not hold its GEMV back: it lets the next kernel start as soon as its own wait returns
(everything before it has ended then), and a GEMV with an epilogue reads x and streams its weights at once,
waiting for the shrink only before the epilogue. The shrink runs beside the GEMV's main loop instead of before
it, so fewer, longer splits cost nothing while it ends before the main loop does, and make the epilogue's load
smaller: on an H200 one 8B layer with a rank-16 adapter took 120.8 us at 64 partial sums a row against 122.1 at 256
and 136.9 at 32, whose down-projection shrink outlasted its GEMV (`bench_lora --cases layer-1 --epilogue-widths`).
A GEMV given an epilogue must be the next launch after its shrink. Reference: `lora_ref` on the projection's input.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import check_device, check_float, next_power_of_2
from radixmesh.kernels._jit import unspecialized
from radixmesh.kernels._pdl import gdc_launch_dependents, gdc_wait, pdl_args

MAX_SPLITS = 16
"""Most programs sharing one slice's K range (the epilogue adds this many partial sums per row)."""
EPILOGUE_WIDTH = 64
"""Most partial sums per row an epilogue loads at once (splits times the rank's power of 2), by default: every
GEMV program loads its rows' partials, so the width is paid once per program (`bench_lora --epilogue-widths`)."""
MIN_SPLIT_K = 1024
"""Fewest input features a split of the shrink takes on a GPU."""
MAX_SPLIT_K = 4096
"""Most input features a split of the shrink takes on a GPU where `MAX_SPLITS` allows (high ranks: a shrink that
outlasts its GEMV would hold the epilogue back)."""
SHRINK_TILE = 4096
"""Elements of A one program loads per step of its loop on a GPU (`BLOCK_K` times the rank's power of 2)."""


class LoraEpilogue(NamedTuple):
    """What a GEMV's epilogue needs to add one row's adapter: the shrink's partial sums and the slot buffers."""

    xa: torch.Tensor
    """float32 `[num_splits, 1, num_slices * R]`: partial sums of `h @ A_i.T` (not normed)."""
    b: torch.Tensor
    """`[num_slots, N, R]`: slice i's B in the rows of its output columns."""
    slots: torch.Tensor
    """`[>= 1]` int32: the row's slot in element 0 (-1: none)."""
    ranks: torch.Tensor
    """`[num_slots]` int32 (0: empty)."""
    scalings: torch.Tensor
    """`[num_slots]` float32."""
    slice_sizes: tuple[int, ...]
    """Output columns of each slice, in order (1 to 3)."""


@triton.jit
def lora_epilogue(xa_ptr, b_ptr, slots_ptr, ranks_ptr, scalings_ptr, offs_n, n_ok, n0, n1, num_splits,
                  stride_split, stride_bs, stride_bn, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """float32 `[BLOCK_N]`: `scaling * xa_i(n) . B[slot, n, :rank]` of output rows `offs_n` (0 where `n_ok` is
    false, for slot -1 and for an empty slot); `xa` the sum of `num_splits <= BLOCK_S` partials."""
    slot = tl.load(slots_ptr)
    safe = tl.maximum(slot, 0)
    rank = tl.where(slot >= 0, tl.load(ranks_ptr + safe), 0)
    j = tl.arange(0, BLOCK_S * BLOCK_R)  # (split, r) pairs: every partial of a row in one load
    split = j // BLOCK_R
    r = j % BLOCK_R
    mask = n_ok[:, None] & ((split < num_splits) & (r < rank) & (r < R))[None, :]
    piece = (offs_n >= n0).to(tl.int32) + (offs_n >= n0 + n1).to(tl.int32)
    xa = tl.load(xa_ptr + split[None, :] * stride_split + (piece * R)[:, None] + r[None, :], mask=mask, other=0.0)
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    # [BLOCK_N, BLOCK_S * BLOCK_R]: B's row repeated for each split (the same addresses: L1)
    b = tl.load(b_ptr + safe.to(tl.int64) * stride_bs + rows[:, None] * stride_bn + r[None, :], mask=mask, other=0.0)
    scaling = tl.where(slot >= 0, tl.load(scalings_ptr + safe), 0.0)
    return scaling * tl.sum(xa * b.to(tl.float32), axis=1)


def epilogue_args(lora: LoraEpilogue | None, n: int, device: torch.device, dummy: torch.Tensor
                  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(positional arguments from `xa_ptr` to `stride_bn`, constexprs `HAS_LORA`, `R`, `BLOCK_R`, `BLOCK_S`) of a
    GEMV launch over `n` output rows (`n`: the rows of the stacked weight, B's rows); `dummy`: any tensor, for no
    adapter."""
    if lora is None:
        return ((dummy, dummy, dummy, dummy, dummy, 0, 0, 1, 0, 0, 0),
                {"HAS_LORA": False, "R": 1, "BLOCK_R": 1, "BLOCK_S": 1})
    check_lora_epilogue(lora, n, device)
    sizes = (*lora.slice_sizes, 0, 0)
    max_rank = lora.b.shape[2]
    return ((lora.xa, lora.b, lora.slots, lora.ranks, lora.scalings, sizes[0], sizes[1], lora.xa.shape[0],
             lora.xa.stride(0), lora.b.stride(0), lora.b.stride(1)),
            {"HAS_LORA": True, "R": max_rank, "BLOCK_R": next_power_of_2(max_rank),
             "BLOCK_S": next_power_of_2(lora.xa.shape[0])})


def check_lora_epilogue(lora: LoraEpilogue, n: int, device: torch.device) -> None:
    """Shapes, dtypes and devices of an epilogue for a GEMV of `n` output rows."""
    xa, b = lora.xa, lora.b
    sizes = lora.slice_sizes
    assert 1 <= len(sizes) <= 3 and min(sizes) >= 1 and sum(sizes) == n, f"slices {sizes} must cover the {n} rows"
    assert b.dim() == 3 and b.shape[1] == n and b.stride(2) == 1, f"b must be [slots, {n}, R], got {tuple(b.shape)}"
    width = len(sizes) * b.shape[2]
    assert xa.dtype == torch.float32 and xa.dim() == 3 and tuple(xa.shape[1:]) == (1, width) and xa.is_contiguous(), (
        f"xa must be a contiguous float32 [splits, 1, {width}], got {xa.dtype} {tuple(xa.shape)}")
    assert 1 <= xa.shape[0] <= 64, f"1..64 splits, got {xa.shape[0]}"
    for name, t, dtype in (("slots", lora.slots, torch.int32), ("ranks", lora.ranks, torch.int32),
                           ("scalings", lora.scalings, torch.float32)):
        assert t.dtype == dtype and t.dim() == 1 and t.is_contiguous(), f"{name} must be a contiguous {dtype} 1-D"
    assert lora.slots.numel() >= 1 and lora.ranks.shape == lora.scalings.shape == (b.shape[0],), (
        "a slot; a rank and a scaling per slot")
    for name, t in (("xa", xa), ("b", b), ("slots", lora.slots), ("ranks", lora.ranks), ("scalings", lora.scalings)):
        check_device(name, t, device)


@triton.jit
def _input_tile(x_ptr, r_ptr, nw_ptr, cols, K, NORM: tl.constexpr):
    """The projection's input at `cols`, float32: x, or `(x + r)` rounded to x's dtype times `nw` (NORM)."""
    k_ok = cols < K
    x = tl.load(x_ptr + cols, mask=k_ok, other=0.0)
    if NORM:
        summed = (x.to(tl.float32) + tl.load(r_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)).to(
            x_ptr.dtype.element_ty)
        return summed.to(tl.float32) * tl.load(nw_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
    return x.to(tl.float32)


@triton.jit(**unspecialized(ints=("K",)))
def _shrink_kernel(x_ptr, r_ptr, nw_ptr, a_ptr, slots_ptr, ranks_ptr, xa_ptr, K, k_per_split, stride_as,
                   stride_ar, stride_split, R: tl.constexpr, NORM: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    piece = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(slots_ptr)
    safe = tl.maximum(slot, 0)
    rank = tl.where(slot >= 0, tl.load(ranks_ptr + safe), 0)
    r = tl.arange(0, BLOCK_R)
    r_ok = (r < rank) & (r < R)
    offs_k = tl.arange(0, BLOCK_K)
    k0 = split * k_per_split
    k_end = tl.minimum(K, k0 + k_per_split)
    a_rows = a_ptr + safe.to(tl.int64) * stride_as + (piece * R + r).to(tl.int64)[None, :] * stride_ar
    cols = k0 + offs_k
    at = tl.load(a_rows + cols[:, None], mask=(cols < k_end)[:, None] & r_ok[None, :], other=0.0)  # A.T tile
    if PDL:
        gdc_wait()  # everything before this kernel has ended: the GEMV after it may read x from now on
        gdc_launch_dependents()
    acc = _input_tile(x_ptr, r_ptr, nw_ptr, tl.where(cols < k_end, cols, K), K, NORM)[:, None] * at.to(tl.float32)
    for k in range(k0 + BLOCK_K, k_end, BLOCK_K):
        cols = k + offs_k
        at = tl.load(a_rows + cols[:, None], mask=(cols < k_end)[:, None] & r_ok[None, :], other=0.0)
        acc += _input_tile(x_ptr, r_ptr, nw_ptr, tl.where(cols < k_end, cols, K), K, NORM)[:, None] * at.to(
            tl.float32)
    tl.store(xa_ptr + split * stride_split + piece * R + r, tl.sum(acc, axis=0), mask=r < R)


def shrink_tiles(k: int, max_rank: int, cpu: bool, width: int = EPILOGUE_WIDTH) -> tuple[int, int, int]:
    """(num_splits, block_k, num_warps) of the shrink: splits times R's power of 2 at most `width`; on a GPU K in
    pieces of MIN_SPLIT_K to MAX_SPLIT_K features (the upper bound first: more splits for a long K at a high rank),
    at most MAX_SPLITS, and `SHRINK_TILE` elements of A a loop step."""
    splits = max(1, width // next_power_of_2(max_rank))
    if cpu:
        return max(1, min(4, splits, k // 32)), 32, 1
    block_k = max(16, min(512, SHRINK_TILE // next_power_of_2(max_rank)))
    splits = min(max(splits, triton.cdiv(k, MAX_SPLIT_K)), k // MIN_SPLIT_K)
    return max(1, min(MAX_SPLITS, splits)), block_k, 4


def lora_gemv_shrink(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, ranks: torch.Tensor,
                     scalings: torch.Tensor, slice_sizes: tuple[int, ...], residual: torch.Tensor | None = None,
                     norm_weight: torch.Tensor | None = None, tiles: tuple[int, int, int] | None = None
                     ) -> LoraEpilogue:
    """The shrink of one row `x` `[1, K]` (with `residual` and `norm_weight`: of `(x + residual) * norm_weight`,
    the GEMV applying the norm's scale) against the adapter of `slots[0]`: the epilogue for a GEMV over B's rows.
    `a` `[num_slots, num_slices * R, K]`, `b` `[num_slots, N, R]` as in `radixmesh.kernels.lora`; `tiles`
    (num_splits, block_k, num_warps) or `shrink_tiles`."""
    check_float("x", x)
    k = x.shape[-1]
    assert tuple(x.shape) == (1, k) and x.is_contiguous(), f"x must be a contiguous [1, K], got {tuple(x.shape)}"
    norm = residual is not None
    assert norm == (norm_weight is not None), "the norm takes both residual and norm_weight"
    if residual is not None and norm_weight is not None:
        check_device("residual", residual, x.device)
        check_device("norm_weight", norm_weight, x.device)
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous(), (
            f"residual must be a contiguous [1, {k}] {x.dtype}, got {residual.dtype} {tuple(residual.shape)}")
        assert tuple(norm_weight.shape) == (k,) and norm_weight.is_contiguous(), f"norm_weight must be [{k}]"
    num_slices, max_rank = len(slice_sizes), b.shape[2]
    assert a.dim() == 3 and tuple(a.shape[1:]) == (num_slices * max_rank, k) and a.dtype == x.dtype, (
        f"a must be [slots, {num_slices * max_rank}, {k}] {x.dtype}, got {a.dtype} {tuple(a.shape)}")
    assert a.stride(2) == 1 and a.shape[0] == b.shape[0] and b.dtype == x.dtype, (
        f"a (last dim contiguous) and b ({b.dtype}) must be x's dtype with as many slots")
    check_device("a", a, x.device)
    num_splits, block_k, num_warps = tiles or shrink_tiles(k, max_rank, x.device.type == "cpu")
    assert 1 <= num_splits <= 64 and block_k >= 16 and block_k & (block_k - 1) == 0, (
        f"num_splits 1..64 and block_k a power of 2 >= 16, got {num_splits}, {block_k}")
    k_per_split = triton.cdiv(triton.cdiv(k, num_splits), block_k) * block_k
    num_splits = triton.cdiv(k, k_per_split)  # (no empty split)
    xa = torch.empty((num_splits, 1, num_slices * max_rank), dtype=torch.float32, device=x.device)
    lora = LoraEpilogue(xa, b, slots, ranks, scalings, tuple(slice_sizes))
    check_lora_epilogue(lora, sum(slice_sizes), x.device)
    _shrink_kernel[(num_slices, num_splits)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, a, slots, ranks,
        xa, k, k_per_split, a.stride(0), a.stride(1), xa.stride(0), R=max_rank, NORM=norm,
        BLOCK_R=next_power_of_2(max_rank), BLOCK_K=block_k, num_warps=num_warps, **pdl_args(x.device))
    return lora
