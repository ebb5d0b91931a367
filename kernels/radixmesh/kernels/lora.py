"""Batched LoRA: many adapters (and the base model) in one batch, in two launches per projection.

The ideas of Punica and S-LoRA: every adapter's A and B live in slot buffers on the GPU, and a batch
says per row (decode) or per segment of rows (prefill) which slot it uses; one "shrink" launch computes
`x @ A.T` (rank r) for every row against its own adapter, one "expand" launch adds `scaling * xa @ B.T`
into the base layer's output in place. Layouts:

    a  [num_slots, num_slices * R, in]   slice i's A in rows i*R .. i*R + rank - 1 (R: the max rank)
    b  [num_slots, out, R]               slice i's B in the rows of its output columns
    ranks [num_slots] int32, scalings [num_slots] float32 (alpha / r, or alpha / sqrt(r) for rsLoRA)

Slices serve the stacked projections: q/k/v (three B's writing column slices of one output, their A's
read in the same pass over x) and gate/up (two). Per row (decode) a program handles one row against its
adapter, summing products in registers (a gathered GEMV; rows of one adapter share its tiles in L2) and
splitting K over several programs whose partial sums the expand adds up (batch 1 would otherwise use
three SMs); per segment (prefill) programs take `block_m` rows of one segment on the tensor cores.

Rows of slot -1 are skipped; ranks below R read only their rows of A and B. Launches depend only on host
ints (rows, segments, the longest segment, R, the slices), the slots being a device tensor, so a decode
step captures in a CUDA graph. Reference: `lora_ref`; benchmark: `bench_lora`.

These per-row launches ("rows") are one of four kernel sets for a decode batch (`KERNELS`); two others, in
`radixmesh.kernels.lora_grouped`, read each adapter once for all its rows ("grouped") or run shrink and expand
as one launch for a few rows ("fused"). `lora_apply(kernels="auto")` picks the per-row launches, the fastest
of the three measured on an H200 (8B shape, rank 16: per layer 61 us at 32 rows over 16 adapters against 102
grouped and 167 fused; 26 us at one row against 35 grouped); prefill segments always take the per-segment
launches here. The fourth, "epilogue" (`radixmesh.kernels.lora_gemv`), is not a call of `lora_apply`: at one
row the base projection's GEMV adds the adapter in its epilogue after one shrink launch per layer input, and
keeps its fused norm, rotary and SiLU (4 LoRA launches a layer instead of 8 plus the 4 the fusions save).
The model's projections take it at one row under "auto" and "epilogue" where the GEMV runs; a `lora_apply`
call with either runs the per-row launches.

Shrink and expand are separate calls (`lora_shrink` into a buffer of `shrink_shape`, then `lora_expand`) so that
the engine can run the shrink on a side CUDA stream while the base projection's GEMM runs on the main one, the
expand after both (`radixmesh.kernels.lora_overlap`); `pdl=False` launches them without PDL there, so that neither
relies on PDL ordering across the streams' fork and join.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import (
    check_device,
    check_float,
    check_last_dim_contiguous,
    dot_dtype,
    dot_precision,
    next_power_of_2,
)
from radixmesh.kernels._jit import unspecialized
from radixmesh.kernels._pdl import gdc_launch_dependents, gdc_wait, pdl_args
from radixmesh.kernels._tiles import mma
from radixmesh.kernels.lora_grouped import fused_apply, fused_tiles, grouped_expand, grouped_shrink, grouped_tiles

MAX_SLICES = 3
"""Most B's writing column slices of one output (q/k/v)."""
MAX_RANK = 256
"""Largest slot rank R (a program holds a row's R values of a slice)."""
KERNELS = ("auto", "rows", "grouped", "fused", "epilogue")
"""Kernel sets of a decode batch: auto (one row with the GEMV: epilogue, else the per-row launches), or one of
them; "rows" is the per-row shrink and expand of this module, "epilogue" the GEMV epilogue of `lora_gemv`."""
FUSED_MAX_ROWS = 4
"""The fused launch is meant for decode batches of at most this many rows (each program recomputes its row's xa)."""


@dataclass(frozen=True)
class LoraBatch:
    """Which adapter slot each row of a batch uses: per row (decode), or per segment of consecutive rows."""

    slots: torch.Tensor
    """`[num_segments]` int32 on the device: a slot per segment (per row without `seg_starts`), -1 for none."""
    seg_starts: torch.Tensor | None
    """`[num_segments + 1]` int32 on the device: segment i is rows `seg_starts[i] .. seg_starts[i+1] - 1`."""
    max_seg_len: int
    """Rows of the longest segment (a host int: it sizes the launch; 1 per row)."""

    @classmethod
    def per_row(cls, slots: torch.Tensor) -> LoraBatch:
        return cls(slots, None, 1)

    @property
    def num_segments(self) -> int:
        return int(self.slots.shape[0])


@dataclass(frozen=True)
class LoraConfig:
    """Tiles of the two LoRA launches."""

    block_m: int
    """Rows per program (1 per row: registers; 16+ per segment: tensor cores)."""
    block_k: int
    """The shrink's reduction step over the input features."""
    block_n: int
    """Output columns per expand program."""
    num_splits: int = 1
    """Programs sharing one row's K range in the shrink (their partial sums are added by the expand)."""
    num_warps: int = 4
    """Warps per program."""

    def __post_init__(self) -> None:
        for name in ("block_m", "block_k", "block_n"):
            value = getattr(self, name)
            assert value >= 1 and value & (value - 1) == 0, f"{name} must be a power of 2, got {value}"
        assert self.block_m <= 8 or self.block_m >= 16, f"block_m {self.block_m}: 1..8 or 16+"
        assert 1 <= self.num_splits <= 64, f"num_splits must be in [1, 64], got {self.num_splits}"


def default_config(batch: LoraBatch, in_features: int, num_slices: int, device: torch.device) -> LoraConfig:
    """Per row: one row a program, K split until about 256 programs run. Per segment: rows in blocks by
    the longest segment. The interpreter gets small tiles."""
    cpu = device.type == "cpu"
    if batch.seg_starts is None:
        block_m = 1
    else:
        block_m = min(64, max(16, next_power_of_2(batch.max_seg_len)))
    programs = batch.num_segments * triton.cdiv(batch.max_seg_len, block_m) * num_slices
    splits = max(1, min(16, 256 // max(1, programs), in_features // 512))
    if cpu:
        return LoraConfig(block_m, 32, 16, 1, 1)
    return LoraConfig(block_m, 256 if block_m == 1 else 64, 128, splits, 4)


def choose_kernels(kernels: str, batch: LoraBatch, max_rank: int) -> str:
    """The kernel set a `lora_apply` of a batch runs: "rows", "grouped" or "fused" (segments, "auto" and
    "epilogue", whose GEMV epilogue is the projection's: "rows")."""
    assert kernels in KERNELS, f"kernels must be one of {KERNELS}, got {kernels!r}"
    if batch.seg_starts is not None:
        return "rows"
    return "rows" if kernels in ("auto", "epilogue") else kernels


def kernel_config(kind: str, batch: LoraBatch, in_features: int, slice_sizes: tuple[int, ...], max_rank: int,
                  num_slots: int, device: torch.device) -> LoraConfig:
    """Default tiles of a kernel set (`choose_kernels`) for a batch."""
    cpu = device.type == "cpu"
    rows = batch.num_segments
    if kind == "grouped":
        return LoraConfig(*grouped_tiles(rows, num_slots, in_features, len(slice_sizes), cpu))
    if kind == "fused":
        block_k, block_n, num_warps = fused_tiles(rows, max_rank, slice_sizes, cpu)
        return LoraConfig(1, block_k, block_n, 1, num_warps)
    return default_config(batch, in_features, len(slice_sizes), device)


@triton.jit
def _segment_rows(slots_ptr, seg_ptr, seg, blk, SEGMENTED: tl.constexpr, BLOCK_M: tl.constexpr):
    """(slot, first row, end row) of block `blk` of segment `seg`."""
    slot = tl.load(slots_ptr + seg)
    if SEGMENTED:
        start = tl.load(seg_ptr + seg)
        end = tl.load(seg_ptr + seg + 1)
    else:
        start = seg
        end = seg + 1
    return slot, start + blk * BLOCK_M, end


@triton.jit(**unspecialized(ints=("K",)))
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, seg_ptr, ranks_ptr, xa_ptr, K, k_per_split, num_splits,
                   stride_x, stride_as, stride_ar, stride_split, stride_xa,
                   R: tl.constexpr, SEGMENTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                   PDL: tl.constexpr):
    pid2 = tl.program_id(2)
    piece = pid2 // num_splits  # the slice (q, k, v ...)
    split = pid2 % num_splits
    if PDL:
        gdc_wait()
    slot, row0, end = _segment_rows(slots_ptr, seg_ptr, tl.program_id(0), tl.program_id(1), SEGMENTED, BLOCK_M)
    if (slot < 0) | (row0 >= end):
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    valid = rows < end
    rows_x = tl.where(valid, rows, row0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_ok = (r < tl.load(ranks_ptr + slot)) & (r < R)  # a rank above R (bad input) reads no other slice
    offs_k = tl.arange(0, BLOCK_K)
    k0 = split * k_per_split
    k_end = tl.minimum(K, k0 + k_per_split)
    x_ptrs = x_ptr + rows_x[:, None] * stride_x + (k0 + offs_k)[None, :]  # [BLOCK_M, BLOCK_K]
    a_ptrs = (a_ptr + slot.to(tl.int64) * stride_as + (piece * R + r).to(tl.int64)[None, :] * stride_ar
              + (k0 + offs_k)[:, None])  # [BLOCK_K, BLOCK_R]: A.T
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(k0, k_end, BLOCK_K):
        k_ok = (k + offs_k) < k_end
        xt = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
        at = tl.load(a_ptrs, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc = mma(xt, at, acc, USE_DOT, False, DOT_DTYPE, PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    if PDL:
        gdc_launch_dependents()
    out = xa_ptr + split * stride_split + rows.to(tl.int64)[:, None] * stride_xa + (piece * R + r)[None, :]
    tl.store(out, acc, mask=valid[:, None] & (r < R)[None, :])


@triton.jit
def _expand_kernel(xa_ptr, b_ptr, slots_ptr, seg_ptr, ranks_ptr, scalings_ptr, y_ptr, n0, n1, n2, num_splits,
                   tiles_per_slice, stride_split, stride_xa, stride_bs, stride_bn, stride_y,
                   R: tl.constexpr, SEGMENTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                   PDL: tl.constexpr):
    pid2 = tl.program_id(2)
    piece = pid2 // tiles_per_slice
    tile = pid2 % tiles_per_slice
    size = tl.where(piece == 0, n0, tl.where(piece == 1, n1, n2))
    first_col = tl.where(piece == 0, 0, tl.where(piece == 1, n0, n0 + n1))
    if PDL:
        gdc_wait()
    slot, row0, end = _segment_rows(slots_ptr, seg_ptr, tl.program_id(0), tl.program_id(1), SEGMENTED, BLOCK_M)
    if (slot < 0) | (row0 >= end) | (tile * BLOCK_N >= size):
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    valid = rows < end
    rows_x = tl.where(valid, rows, row0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_ok = (r < tl.load(ranks_ptr + slot)) & (r < R)  # a rank above R (bad input) reads no other slice
    xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    xa_ptrs = xa_ptr + rows_x[:, None] * stride_xa + (piece * R + r)[None, :]
    for split in range(num_splits):  # the shrink's partial sums over K
        xa += tl.load(xa_ptrs + split * stride_split, mask=r_ok[None, :], other=0.0)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < size
    cols = first_col + tl.where(n_ok, offs_n, 0)
    bt = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + cols.to(tl.int64)[None, :] * stride_bn + r[:, None],
                 mask=r_ok[:, None], other=0.0)  # [BLOCK_R, BLOCK_N]: B.T
    acc = mma(xa, bt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), USE_DOT, False, DOT_DTYPE, PRECISION)
    if PDL:
        gdc_launch_dependents()
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
    mask = valid[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32) + tl.load(scalings_ptr + slot) * acc
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _check_batch(batch: LoraBatch, rows: int, ranks: torch.Tensor, device: torch.device) -> None:
    for name, t in (("slots", batch.slots), ("ranks", ranks)):
        check_device(name, t, device)
        assert t.dtype == torch.int32 and t.dim() == 1 and t.is_contiguous(), f"{name} must be a contiguous int32 1-D"
    if batch.seg_starts is None:
        assert batch.num_segments == rows, f"{batch.num_segments} slots for {rows} rows (one per row)"
    else:
        check_device("seg_starts", batch.seg_starts, device)
        assert batch.seg_starts.dtype == torch.int32 and tuple(batch.seg_starts.shape) == (batch.num_segments + 1,), (
            f"seg_starts must be int32 [{batch.num_segments + 1}], got {batch.seg_starts.dtype} "
            f"{tuple(batch.seg_starts.shape)}")
        assert batch.max_seg_len >= 1, f"max_seg_len must be >= 1, got {batch.max_seg_len}"


def _operand(x: torch.Tensor) -> tuple[tl.dtype, str]:
    """Operand dtype and precision of the tensor-core path for activations like `x`."""
    op = dot_dtype(x.dtype, x.device)
    return op, dot_precision(op)


def _check_shrink(x: torch.Tensor, a: torch.Tensor, batch: LoraBatch, ranks: torch.Tensor, num_slices: int) -> None:
    assert x.dim() == 2 and a.dim() == 3, f"x must be [M, in] and a [slots, slices*R, in]: {x.shape}, {a.shape}"
    assert 1 <= num_slices <= MAX_SLICES and a.shape[1] % num_slices == 0, (
        f"a has {a.shape[1]} rows, not a multiple of {num_slices} slices (1..{MAX_SLICES})")
    rows, k = x.shape
    max_rank = a.shape[1] // num_slices
    assert a.shape[2] == k and 1 <= max_rank <= MAX_RANK, f"a {tuple(a.shape)} does not fit x {tuple(x.shape)}"
    check_float("x", x)
    assert a.dtype == x.dtype, f"a is {a.dtype}, x is {x.dtype}"
    check_device("a", a, x.device)
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("a", a)
    _check_batch(batch, rows, ranks, x.device)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, batch: LoraBatch, ranks: torch.Tensor, num_slices: int = 1,
                out: torch.Tensor | None = None, config: LoraConfig | None = None,
                kernels: str = "rows", pdl: bool = True) -> torch.Tensor:
    """`x @ A.T` of every row's adapter, per slice: float32 `[num_splits, M, num_slices * R]` partial sums
    (rows of slot -1 are not written). `x` `[M, in]`, `a` `[num_slots, num_slices * R, in]`; `kernels`: "rows"
    (per row or segment) or "grouped" (per slot, decode only); `pdl`: the launch may take PDL."""
    _check_shrink(x, a, batch, ranks, num_slices)
    rows, k = x.shape
    max_rank = a.shape[1] // num_slices
    grouped = _is_grouped(kernels, batch)
    cfg = config or kernel_config("grouped" if grouped else "rows", batch, k, (1,) * num_slices, max_rank,
                                  ranks.shape[0], x.device)
    shape = shrink_shape(cfg, rows, num_slices, max_rank)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=x.device)
    check_device("out", out, x.device)
    assert out.dtype == torch.float32 and tuple(out.shape) == shape and out.stride(2) == 1, (
        f"out must be float32 {list(shape)} with contiguous rows, got {out.dtype} {tuple(out.shape)}")
    if rows == 0 or batch.num_segments == 0:
        return out
    op, precision = _operand(x)
    if grouped:
        assert cfg.block_m >= 16, f"grouped programs take 16+ rows on the tensor cores, block_m {cfg.block_m}"
        grouped_shrink(x, a, batch.slots, ranks, num_slices, out, cfg.block_m, cfg.block_k, cfg.num_splits,
                       cfg.num_warps, op, precision, pdl)
        return out
    use_dot = cfg.block_m >= 16
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.num_splits), cfg.block_k) * cfg.block_k
    grid = (batch.num_segments, triton.cdiv(batch.max_seg_len, cfg.block_m), num_slices * cfg.num_splits)
    _shrink_kernel[grid](
        x, a, batch.slots, batch.seg_starts if batch.seg_starts is not None else batch.slots, ranks, out, k,
        k_per_split, cfg.num_splits, x.stride(0), a.stride(0), a.stride(1), out.stride(0), out.stride(1),
        R=max_rank, SEGMENTED=batch.seg_starts is not None, BLOCK_M=cfg.block_m,
        BLOCK_R=max(16 if use_dot else 1, next_power_of_2(max_rank)), BLOCK_K=cfg.block_k, USE_DOT=use_dot,
        DOT_DTYPE=op, PRECISION=precision, num_warps=cfg.num_warps, **pdl_args(x.device, pdl))
    return out


def shrink_shape(config: LoraConfig, rows: int, num_slices: int, max_rank: int) -> tuple[int, int, int]:
    """Shape of the float32 buffer `lora_shrink` writes with `config` (one partial sum per K split)."""
    return config.num_splits, rows, num_slices * max_rank


def _is_grouped(kernels: str, batch: LoraBatch) -> bool:
    assert kernels in ("rows", "grouped"), f"shrink and expand run the rows or grouped kernels, not {kernels!r}"
    assert kernels == "rows" or batch.seg_starts is None, "the grouped kernels take one slot per row (decode)"
    return kernels == "grouped"


def _check_outputs(b: torch.Tensor, batch: LoraBatch, ranks: torch.Tensor, scalings: torch.Tensor, y: torch.Tensor,
                   slice_sizes: tuple[int, ...]) -> None:
    assert b.dim() == 3 and y.dim() == 2, "b [slots, out, R], y [M, out]"
    assert 1 <= len(slice_sizes) <= MAX_SLICES and min(slice_sizes) >= 1, f"1..{MAX_SLICES} slices: {slice_sizes}"
    rows, out_features = y.shape
    assert sum(slice_sizes) == out_features == b.shape[1], (
        f"slices {slice_sizes} must cover y's {out_features} columns and b's {b.shape[1]} rows")
    check_float("y", y)
    assert b.dtype == y.dtype, f"b is {b.dtype}, y is {y.dtype}"
    for name, t in (("b", b), ("scalings", scalings)):
        check_device(name, t, y.device)
    assert scalings.dtype == torch.float32 and scalings.shape == ranks.shape, "scalings: float32, one per slot"
    check_last_dim_contiguous("b", b)
    check_last_dim_contiguous("y", y)
    _check_batch(batch, rows, ranks, y.device)


def lora_expand(xa: torch.Tensor, b: torch.Tensor, batch: LoraBatch, ranks: torch.Tensor, scalings: torch.Tensor,
                y: torch.Tensor, slice_sizes: tuple[int, ...], config: LoraConfig | None = None,
                kernels: str = "rows", pdl: bool = True) -> torch.Tensor:
    """`y[:, cols_i] += scaling * xa_i @ B_i.T` in place for every row with an adapter; returns `y`.

    `xa` from `lora_shrink` (of the same `kernels`); `b` `[num_slots, sum(slice_sizes), R]`; `y`
    `[M, sum(slice_sizes)]` (b's dtype); `pdl`: the launch may take PDL."""
    _check_outputs(b, batch, ranks, scalings, y, slice_sizes)
    rows, max_rank = y.shape[0], b.shape[2]
    assert xa.dim() == 3 and tuple(xa.shape[1:]) == (rows, len(slice_sizes) * max_rank) and (
        xa.dtype == torch.float32), (
        f"xa must be float32 [splits, {rows}, {len(slice_sizes) * max_rank}], got {xa.dtype} {tuple(xa.shape)}")
    check_device("xa", xa, y.device)
    check_last_dim_contiguous("xa", xa)
    grouped = _is_grouped(kernels, batch)
    cfg = config or kernel_config("grouped" if grouped else "rows", batch, 0, slice_sizes, max_rank,
                                  ranks.shape[0], y.device)
    if rows == 0 or batch.num_segments == 0:
        return y
    if grouped:
        assert cfg.block_m >= 16, f"grouped programs take 16+ rows on the tensor cores, block_m {cfg.block_m}"
        grouped_expand(xa, b, batch.slots, ranks, scalings, y, slice_sizes, cfg.block_m, cfg.block_n, cfg.num_warps,
                       pdl)
        return y
    use_dot = cfg.block_m >= 16
    op, precision = _operand(y)
    sizes = (*slice_sizes, 0, 0)[:MAX_SLICES]
    tiles = triton.cdiv(max(slice_sizes), cfg.block_n)
    grid = (batch.num_segments, triton.cdiv(batch.max_seg_len, cfg.block_m), len(slice_sizes) * tiles)
    _expand_kernel[grid](
        xa, b, batch.slots, batch.seg_starts if batch.seg_starts is not None else batch.slots, ranks, scalings, y,
        *sizes, xa.shape[0], tiles, xa.stride(0), xa.stride(1), b.stride(0), b.stride(1), y.stride(0),
        R=max_rank, SEGMENTED=batch.seg_starts is not None, BLOCK_M=cfg.block_m,
        BLOCK_R=max(16 if use_dot else 1, next_power_of_2(max_rank)), BLOCK_N=cfg.block_n, USE_DOT=use_dot,
        DOT_DTYPE=op, PRECISION=precision, num_warps=cfg.num_warps, **pdl_args(y.device, pdl))
    return y


def lora_apply(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoraBatch,
               ranks: torch.Tensor, scalings: torch.Tensor, slice_sizes: tuple[int, ...],
               config: LoraConfig | None = None, xa: torch.Tensor | None = None, kernels: str = "auto") -> torch.Tensor:
    """Adds every row's adapter output to the base layer's output `y` in place: shrink then expand, or one fused
    launch; `kernels` one of `KERNELS` (`choose_kernels`), `config` tiles for the set it picks."""
    max_rank = b.shape[2]
    kind = choose_kernels(kernels, batch, max_rank)
    cfg = config or kernel_config(kind, batch, x.shape[1], slice_sizes, max_rank, ranks.shape[0], x.device)
    if kind != "fused":
        xa = lora_shrink(x, a, batch, ranks, len(slice_sizes), xa, cfg, kind)
        return lora_expand(xa, b, batch, ranks, scalings, y, slice_sizes, cfg, kind)
    _check_shrink(x, a, batch, ranks, len(slice_sizes))
    _check_outputs(b, batch, ranks, scalings, y, slice_sizes)
    assert y.shape[0] == x.shape[0] and a.shape[1] == len(slice_sizes) * max_rank, (
        f"x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)} and y {tuple(y.shape)} do not match")
    if x.shape[0]:
        fused_apply(x, y, a, b, batch.slots, ranks, scalings, slice_sizes, cfg.block_k, cfg.block_n, cfg.num_warps)
    return y
