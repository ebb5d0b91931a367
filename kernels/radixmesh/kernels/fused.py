"""Fused elementwise kernels of a decoder layer: RMSNorm (with the residual add), rotary (with the
new token's K/V store into the pool, and Qwen3's per-head q/k RMSNorm before it), SiLU-and-mul.

Each replaces a chain of small PyTorch ops (one launch each) with one launch, which is what
a batch-1 decode step is made of once the weights are read. Rounding follows the PyTorch
layers in `radixmesh.engine.models.layers` step for step: sums are rounded to the activation
dtype before they are normalized, the normalized row is rounded before the weight multiplies
it, SiLU's output is rounded before the product, and rotary math runs in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import (
    check_device,
    check_float,
    check_index,
    check_kv,
    check_last_dim_contiguous,
    check_shape,
    next_power_of_2,
)
from radixmesh.kernels._fp8_cast import emulate_cast
from radixmesh.kernels._jit import unspecialized
from radixmesh.kernels._pdl import gdc_launch_dependents, gdc_wait, pdl_args
from radixmesh.kernels.kv_store import fp8_store_args, to_pool

_ACT_BLOCK = 1024  # elements of one SiLU-and-mul program


class KVStoreTarget(NamedTuple):
    """Where `apply_rotary_` also writes a layer's new K/V: `v` `[tokens, kv_heads, head_dim]`
    (contiguous last dim), the layer's pool buffers `[num_slots, kv_heads, head_dim]` and the
    tokens' slots `loc` `[tokens]`."""

    v: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    loc: torch.Tensor
    k_scale: float = 1.0
    """FP8 pools: K is stored as `fp8(k / k_scale)` (see `kv_store.store_kv`); ignored otherwise."""
    v_scale: float = 1.0

    def check(self, tokens: int, num_kv_heads: int, head_dim: int, device: torch.device) -> None:
        for name, t in (("v", self.v), ("k_buffer", self.k_buffer), ("v_buffer", self.v_buffer), ("loc", self.loc)):
            check_device(name, t, device)
        check_shape("v", self.v, (tokens, num_kv_heads, head_dim))
        check_float("v", self.v)
        check_last_dim_contiguous("v", self.v)
        assert self.k_buffer.dim() == 3 and tuple(self.k_buffer.shape[1:]) == (num_kv_heads, head_dim), (
            f"k_buffer must be [num_slots, {num_kv_heads}, {head_dim}], got {tuple(self.k_buffer.shape)}")
        check_shape("v_buffer", self.v_buffer, tuple(self.k_buffer.shape))
        for name, t in (("k_buffer", self.k_buffer), ("v_buffer", self.v_buffer)):
            check_kv(name, t)
            check_last_dim_contiguous(name, t)
        assert self.v_buffer.dtype == self.k_buffer.dtype, (
            f"v_buffer is {self.v_buffer.dtype}, k_buffer is {self.k_buffer.dtype}")
        check_index("loc", self.loc)
        check_shape("loc", self.loc, (tokens,))


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of `x` `[rows, hidden]` (or of `x + residual`), scaled by `weight` `[hidden]`.

    Returns `(normed, new_residual)`: with a residual, `new_residual = x + residual` (in x's
    dtype) is what was normalized and what the next layer adds to; without one it is None.
    """
    device = x.device
    check_device("x", x, device)
    check_device("weight", weight, device)
    assert x.dim() == 2, f"x must be [rows, hidden], got shape {tuple(x.shape)}"
    rows, hidden = x.shape
    check_shape("weight", weight, (hidden,))
    check_float("x", x)
    check_float("weight", weight)
    check_last_dim_contiguous("x", x)
    assert weight.stride(0) == 1 or hidden == 1, f"weight must be contiguous, got stride {weight.stride()}"
    out = torch.empty((rows, hidden), dtype=x.dtype, device=device)
    res_out = None
    if residual is not None:
        check_device("residual", residual, device)
        check_shape("residual", residual, (rows, hidden))
        assert residual.dtype == x.dtype, f"residual has dtype {residual.dtype}, x has {x.dtype}"
        check_last_dim_contiguous("residual", residual)
        res_out = torch.empty_like(out)
    if rows == 0:
        return out, res_out
    block = next_power_of_2(hidden)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, res_out if res_out is not None else out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), out.stride(0),
        hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return out, res_out


class QKNorm(NamedTuple):
    """Per-head RMSNorm of q and k that `apply_rotary_` applies before rotating (Qwen3): weights `[head_dim]`."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


@triton.jit
def _head_rms_norm(x1, x2, w_ptr, eps, half, offs_d, d_mask, ptr):
    """RMSNorm of heads given as fp32 halves `[BLOCK_H, BLOCK_D]`, rounded where `RMSNorm` rounds (the normed
    row, then its product with the weight, in the dtype `ptr` points to); returned as fp32 halves."""
    dtype = ptr.dtype.element_ty
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half) + eps)
    w1 = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + half + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    n1 = (x1 * rstd[:, None]).to(dtype).to(tl.float32)
    n2 = (x2 * rstd[:, None]).to(dtype).to(tl.float32)
    return (w1 * n1).to(dtype).to(tl.float32), (w2 * n2).to(dtype).to(tl.float32)


@triton.jit
def _rotate_rows(ptr, tok, stride_tok, stride_head, num_heads, cos, sin, half, w_ptr, eps,
                 NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate one token's heads `[num_heads, 2 * half]` in place (RMSNorm-ed first with `NORM`); returns them
    rotated (fp32) as the two halves `[BLOCK_H, BLOCK_D]` each, with their mask."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < half)
    lo = ptr + tok * stride_tok + offs_h[:, None] * stride_head + offs_d[None, :]
    x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo + half, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        x1, x2 = _head_rms_norm(x1, x2, w_ptr, eps, half, offs_d, offs_d < half, ptr)
    r1 = (x1 * cos - x2 * sin).to(ptr.dtype.element_ty)
    r2 = (x2 * cos + x1 * sin).to(ptr.dtype.element_ty)
    tl.store(lo, r1, mask=mask)
    tl.store(lo + half, r2, mask=mask)
    return r1, r2, mask


@triton.jit(**unspecialized(pointers=("pos_ptr", "loc_ptr")))  # loc: a slice of the slot free list
def _rotary_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, k_buf_ptr, v_buf_ptr, loc_ptr, qw_ptr, kw_ptr,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_cache,
    stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head,
    num_q_heads, num_k_heads, half, inv_k_scale, inv_v_scale, fp8_max, eps,
    STORE_KV: tl.constexpr, NORM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr,
):
    # grid (tokens, q parts + 1): a token's q heads in blocks of BLOCK_HQ, then its k heads (and the KV store)
    tok = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    q_parts = tl.num_programs(1) - 1
    if PDL:  # q and k come from the kernel before (radixmesh.kernels._pdl)
        gdc_wait()
        gdc_launch_dependents()
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < half
    cos = tl.load(cos_ptr + pos * stride_cache + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cache + offs_d, mask=d_mask, other=0.0)[None, :]
    if part < q_parts:
        first = part * BLOCK_HQ
        _rotate_rows(q_ptr + first * stride_q_head, tok, stride_q_tok, stride_q_head, num_q_heads - first, cos, sin,
                     half, qw_ptr, eps, NORM, BLOCK_HQ, BLOCK_D)
    else:
        k1, k2, mask_k = _rotate_rows(k_ptr, tok, stride_k_tok, stride_k_head, num_k_heads, cos, sin, half, kw_ptr,
                                      eps, NORM, BLOCK_HK, BLOCK_D)
        if STORE_KV:  # the new token's k (rotated) and v go straight into its pool slot
            slot = tl.load(loc_ptr + tok).to(tl.int64)
            offs_h = tl.arange(0, BLOCK_HK)
            kb = k_buf_ptr + slot * stride_kb_slot + offs_h[:, None] * stride_kb_head + offs_d[None, :]
            tl.store(kb, to_pool(k1, k_buf_ptr, inv_k_scale, fp8_max, IS_FP8, EMULATE), mask=mask_k)
            tl.store(kb + half, to_pool(k2, k_buf_ptr, inv_k_scale, fp8_max, IS_FP8, EMULATE), mask=mask_k)
            v_src = v_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :]
            vb = v_buf_ptr + slot * stride_vb_slot + offs_h[:, None] * stride_vb_head + offs_d[None, :]
            v1 = tl.load(v_src, mask=mask_k)
            v2 = tl.load(v_src + half, mask=mask_k)
            tl.store(vb, to_pool(v1, v_buf_ptr, inv_v_scale, fp8_max, IS_FP8, EMULATE), mask=mask_k)
            tl.store(vb + half, to_pool(v2, v_buf_ptr, inv_v_scale, fp8_max, IS_FP8, EMULATE), mask=mask_k)


ROTARY_Q_HEADS = 8
"""q heads per program of `apply_rotary_` (a token's k heads take one more program): a batch-1 step's launch
spreads over several SMs instead of one program doing all 32 q heads."""


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                  sin_cache: torch.Tensor, kv_store: KVStoreTarget | None = None,
                  qk_norm: QKNorm | None = None, q_heads_per_program: int = ROTARY_Q_HEADS) -> None:
    """Rotate `q` `[tokens, heads, head_dim]` and `k` `[tokens, kv_heads, head_dim]` in place.

    Neox (rotate-half) style; `cos_cache`/`sin_cache` are fp32 `[max_positions, head_dim // 2]`
    and `positions` `[tokens]` indexes them. q and k may be strided views of a fused qkv
    output (contiguous last dim). Positions past the cache are the caller's to prevent.
    With `kv_store`, the same launch also writes the rotated k and `kv_store.v` into the KV
    pool rows `kv_store.loc` (cast to the pool's dtype; FP8 pools through their scales), as
    `store_kv` would. With `qk_norm`, every head of q and k is RMSNorm-ed first (Qwen3), in place too.
    Each program takes `q_heads_per_program` of a token's q heads (a power of 2; the same bits at any value).
    """
    device = q.device
    for name, t in (("q", q), ("k", k), ("positions", positions), ("cos_cache", cos_cache),
                    ("sin_cache", sin_cache)):
        check_device(name, t, device)
    assert q.dim() == 3 and k.dim() == 3, f"q, k must be 3-D, got {tuple(q.shape)}, {tuple(k.shape)}"
    tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert head_dim % 2 == 0, f"head_dim must be even, got {head_dim}"
    check_shape("k", k, (tokens, num_k_heads, head_dim))
    check_index("positions", positions)
    check_shape("positions", positions, (tokens,))
    half = head_dim // 2
    assert cos_cache.dim() == 2 and cos_cache.shape[1] == half, (
        f"cos_cache must be [max_positions, {half}], got {tuple(cos_cache.shape)}")
    check_shape("sin_cache", sin_cache, tuple(cos_cache.shape))
    for name, t in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        assert t.dtype == torch.float32, f"{name} must be float32, got {t.dtype}"
        assert t.is_contiguous(), f"{name} must be contiguous"
    for name, t in (("q", q), ("k", k)):
        check_float(name, t)
        check_last_dim_contiguous(name, t)
    if kv_store is not None:
        kv_store.check(tokens, num_k_heads, head_dim, device)
    if qk_norm is not None:
        for name, w in (("q_weight", qk_norm.q_weight), ("k_weight", qk_norm.k_weight)):
            check_device(name, w, device)
            check_shape(name, w, (head_dim,))
            check_float(name, w)
            assert w.is_contiguous(), f"{name} must be contiguous"
    if tokens == 0:
        return
    v, k_buf, v_buf, loc, k_scale, v_scale = kv_store if kv_store is not None else (k, k, k, positions, 1.0, 1.0)
    inv_k, inv_v, limit, is_fp8 = fp8_store_args(k_buf, k_scale, v_scale)
    qw, kw, eps = qk_norm if qk_norm is not None else (q, k, 0.0)
    assert q_heads_per_program >= 1 and q_heads_per_program & (q_heads_per_program - 1) == 0, (
        f"q_heads_per_program must be a power of 2, got {q_heads_per_program}")
    block_hq = min(q_heads_per_program, next_power_of_2(num_q_heads))
    _rotary_kernel[(tokens, triton.cdiv(num_q_heads, block_hq) + 1)](
        q, k, v, positions, cos_cache, sin_cache, k_buf, v_buf, loc, qw, kw,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_cache.stride(0),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        num_q_heads, num_k_heads, half, inv_k, inv_v, limit, eps,
        STORE_KV=kv_store is not None, NORM=qk_norm is not None, BLOCK_HQ=block_hq,
        BLOCK_HK=next_power_of_2(num_k_heads), BLOCK_D=next_power_of_2(half), IS_FP8=is_fp8,
        EMULATE=emulate_cast(device), **pdl_args(device),
    )


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `x = [gate | up]` `[rows, 2 * width]`; returns `[rows, width]`."""
    check_device("x", x, x.device)
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [rows, 2 * width], got shape {tuple(x.shape)}"
    check_float("x", x)
    check_last_dim_contiguous("x", x)
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    _silu_and_mul_kernel[(rows, triton.cdiv(width, _ACT_BLOCK))](
        x, out, x.stride(0), out.stride(0), width, BLOCK=_ACT_BLOCK,
    )
    return out
