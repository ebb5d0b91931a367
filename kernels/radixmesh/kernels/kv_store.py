"""KV-pool kernels: write new tokens' K/V into their slots, and flatten each request's slot list.

Page size is one token: `k_buffer[slot]` is one token's K `[kv_heads, head_dim]`, and
`req_to_token[row, pos]` is the slot holding position `pos` of the request in `row`.
Attention kernels read a batch's KV through a CSR-style pair: request `i` owns
`kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`, its slots in position order.

An FP8 pool stores `fp8(k / k_scale)` (saturated, one scale per tensor): `to_pool` is that cast, shared
with the rotary kernel's fused store; attention reads `fp8 * k_scale`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import (
    FP8_DTYPES,
    check_device,
    check_float,
    check_index,
    check_kv,
    check_last_dim_contiguous,
    check_shape,
    fp8_max,
    next_power_of_2,
)
from radixmesh.kernels._fp8_cast import cast_fp8, emulate_cast
from radixmesh.kernels._jit import unspecialized

# elements of one tile in the store kernel: enough heads per program to keep the copy wide
_STORE_TILE_ELEMS = 4096
# slots one fill program copies per loop iteration
_FILL_BLOCK = 1024
MAX_INDPTR_BATCH = 1024
"""Largest batch whose `kv_indptr` `fill_kv_indices` computes itself (each program sums the lengths before it)."""


@triton.jit
def to_pool(x, buf_ptr, inv_scale, fp8_max, IS_FP8: tl.constexpr, EMULATE: tl.constexpr):
    """`x` as the pool `buf_ptr` stores it: cast, or for FP8 `fp8(x * inv_scale)` saturated to +-fp8_max."""
    if IS_FP8:
        y = cast_fp8(tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -fp8_max), fp8_max), buf_ptr, EMULATE)
    else:
        y = x.to(buf_ptr.dtype.element_ty)
    return y


@triton.jit
def from_pool(x, DOT_DTYPE: tl.constexpr, IS_FP8: tl.constexpr):
    """A K/V tile read from the pool, as the attention's `tl.dot` operand dtype (FP8 widens through
    float32; the pool's scale is applied by the caller, folded into the softmax scale and the output)."""
    if IS_FP8:
        x = x.to(tl.float32)
    return x.to(DOT_DTYPE)


def fp8_store_args(buffer: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float, float, bool]:
    """`(1 / k_scale, 1 / v_scale, fp8_max, is_fp8)`: what the store kernels take for pool `buffer`."""
    assert k_scale > 0 and v_scale > 0, f"KV scales must be > 0, got {k_scale}, {v_scale}"
    is_fp8 = buffer.dtype in FP8_DTYPES
    return 1.0 / k_scale, 1.0 / v_scale, fp8_max(buffer.dtype) if is_fp8 else 0.0, is_fp8


@triton.jit(**unspecialized(pointers=("loc_ptr",)))  # loc: a slice of the slot free list
def _store_kv_kernel(
    k_buf_ptr, v_buf_ptr, loc_ptr, k_ptr, v_ptr,
    stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    num_kv_heads, head_dim, inv_k_scale, inv_v_scale, fp8_max,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr, EMULATE: tl.constexpr,
):
    tok = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    slot = tl.load(loc_ptr + tok).to(tl.int64)
    tok64 = tok.to(tl.int64)

    k = tl.load(k_ptr + tok64 * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :], mask=mask)
    tl.store(k_buf_ptr + slot * stride_kb_slot + offs_h[:, None] * stride_kb_head + offs_d[None, :],
             to_pool(k, k_buf_ptr, inv_k_scale, fp8_max, IS_FP8, EMULATE), mask=mask)
    v = tl.load(v_ptr + tok64 * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :], mask=mask)
    tl.store(v_buf_ptr + slot * stride_vb_slot + offs_h[:, None] * stride_vb_head + offs_d[None, :],
             to_pool(v, v_buf_ptr, inv_v_scale, fp8_max, IS_FP8, EMULATE), mask=mask)


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write `k`, `v` `[num_tokens, kv_heads, head_dim]` into the buffers' rows `loc` `[num_tokens]`.

    Buffers are `[num_slots, kv_heads, head_dim]`; values are cast to the buffers' dtype, or for FP8
    buffers stored as `fp8(k / k_scale)`, `fp8(v / v_scale)` (saturated).
    `k`/`v` may be strided views (e.g. slices of a fused qkv) with a contiguous last dim.
    """
    device = k_buffer.device
    for name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer), ("loc", loc), ("k", k), ("v", v)):
        check_device(name, t, device)
    assert k_buffer.dim() == 3, f"k_buffer must be [num_slots, kv_heads, head_dim], got {tuple(k_buffer.shape)}"
    check_shape("v_buffer", v_buffer, tuple(k_buffer.shape))
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    check_index("loc", loc)
    num_tokens = loc.shape[0]
    check_shape("k", k, (num_tokens, num_kv_heads, head_dim))
    check_shape("v", v, (num_tokens, num_kv_heads, head_dim))
    for name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer), ("k", k), ("v", v)):
        (check_kv if "buffer" in name else check_float)(name, t)
        check_last_dim_contiguous(name, t)
    assert v_buffer.dtype == k_buffer.dtype, f"v_buffer is {v_buffer.dtype}, k_buffer is {k_buffer.dtype}"
    inv_k, inv_v, limit, is_fp8 = fp8_store_args(k_buffer, k_scale, v_scale)
    if num_tokens == 0:
        return
    block_d = next_power_of_2(head_dim)
    block_h = min(next_power_of_2(num_kv_heads), max(1, _STORE_TILE_ELEMS // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _store_kv_kernel[grid](
        k_buffer, v_buffer, loc, k, v,
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_kv_heads, head_dim, inv_k, inv_v, limit,
        BLOCK_H=block_h, BLOCK_D=block_d, IS_FP8=is_fp8, EMULATE=emulate_cast(device),
    )


@triton.jit
def _fill_kv_indices_kernel(
    req_to_token_ptr, req_pool_indices_ptr, seq_lens_ptr, kv_indptr_ptr, kv_indices_ptr,
    stride_r2t_row,
    BLOCK: tl.constexpr, COMPUTE_INDPTR: tl.constexpr, BLOCK_B: tl.constexpr,
):
    req = tl.program_id(0)
    row = tl.load(req_pool_indices_ptr + req).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int64)
    if COMPUTE_INDPTR:  # each program sums the lengths before its own (small batches: cheaper than a scan launch)
        offs_b = tl.arange(0, BLOCK_B)
        out_start = tl.sum(tl.load(seq_lens_ptr + offs_b, mask=offs_b < req, other=0).to(tl.int64), axis=0)
        tl.store(kv_indptr_ptr + req + 1, (out_start + seq_len).to(kv_indptr_ptr.dtype.element_ty))
        if req == 0:
            tl.store(kv_indptr_ptr, tl.zeros([], dtype=kv_indptr_ptr.dtype.element_ty))
    else:
        out_start = tl.load(kv_indptr_ptr + req).to(tl.int64)
    src = req_to_token_ptr + row * stride_r2t_row
    for off in range(0, seq_len, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < seq_len
        slots = tl.load(src + offs, mask=mask)
        tl.store(kv_indices_ptr + out_start + offs, slots.to(kv_indices_ptr.dtype.element_ty), mask=mask)


def compute_kv_indptr(seq_lens: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Exclusive prefix sum `[batch + 1]` of `seq_lens` `[batch]` (into `out` when given), on the device."""
    check_index("seq_lens", seq_lens)
    batch = seq_lens.shape[0]
    if out is None:
        out = torch.empty(batch + 1, dtype=torch.int64, device=seq_lens.device)
    check_index("kv_indptr", out)
    assert out.shape[0] >= batch + 1, f"kv_indptr has {out.shape[0]} entries, need batch + 1 = {batch + 1}"
    out[:1].zero_()  # a device fill: no host copy, so it may be captured in a CUDA graph
    torch.cumsum(seq_lens, dim=0, dtype=out.dtype, out=out[1:batch + 1])
    return out


def fill_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, compute_indptr: bool = False) -> None:
    """Copy `req_to_token[req_pool_indices[i], :seq_lens[i]]` to `kv_indices[kv_indptr[i]:]` for every i.

    `req_to_token` `[rows, max_context]`; `req_pool_indices`, `seq_lens` `[batch]`; `kv_indptr`
    `[>= batch + 1]` (from `compute_kv_indptr`, or written here with `compute_indptr`, for batches
    of at most `MAX_INDPTR_BATCH`); `kv_indices` `[>= sum(seq_lens)]`, int32 or int64.
    Nothing is read back to the host, so it may run inside a CUDA graph.
    """
    device = req_to_token.device
    for name, t in (("req_to_token", req_to_token), ("req_pool_indices", req_pool_indices),
                    ("seq_lens", seq_lens), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        check_device(name, t, device)
    assert req_to_token.dim() == 2, f"req_to_token must be [rows, max_context], got {tuple(req_to_token.shape)}"
    assert req_to_token.dtype in (torch.int32, torch.int64), f"req_to_token has dtype {req_to_token.dtype}"
    check_last_dim_contiguous("req_to_token", req_to_token)
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens), ("kv_indptr", kv_indptr),
                    ("kv_indices", kv_indices)):
        check_index(name, t)
    batch = req_pool_indices.shape[0]
    check_shape("seq_lens", seq_lens, (batch,))
    assert kv_indptr.shape[0] >= batch + 1, f"kv_indptr has {kv_indptr.shape[0]} entries, need {batch + 1}"
    assert not compute_indptr or batch <= MAX_INDPTR_BATCH, (
        f"compute_indptr takes batches of at most {MAX_INDPTR_BATCH}, got {batch}")
    if batch == 0:
        if compute_indptr:
            kv_indptr[:1].zero_()
        return
    _fill_kv_indices_kernel[(batch,)](
        req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices,
        req_to_token.stride(0),
        BLOCK=_FILL_BLOCK, COMPUTE_INDPTR=compute_indptr, BLOCK_B=next_power_of_2(batch) if compute_indptr else 1,
    )


def build_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     num_indices: int, dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate and fill `(kv_indptr [batch + 1], kv_indices [num_indices])`.

    `num_indices` is `sum(seq_lens)`, known on the host (e.g. from `ForwardBatch.seq_lens_cpu`).
    """
    assert num_indices >= 0, f"num_indices must be >= 0, got {num_indices}"
    kv_indptr = compute_kv_indptr(seq_lens)
    kv_indices = torch.empty(num_indices, dtype=dtype, device=req_to_token.device)
    fill_kv_indices(req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices)
    return kv_indptr, kv_indices
