"""The rotary work a decode step folds into its split-KV attention kernel (`decode_attention`, `ROPE`).

Qwen3's per-head RMSNorm of q and k, the neox rotation and the new token's K/V store, done where the attention
reads q, so a decode step does not launch `fused.apply_rotary_` first. Rounding is `_rotary_kernel`'s step for step
(the same `_head_rms_norm`, the rotated halves rounded to q's and k's dtype), so the results are the same bits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import check_device, check_float, check_index, check_last_dim_contiguous, check_shape
from radixmesh.kernels.fused import _head_rms_norm
from radixmesh.kernels.kv_store import fp8_store_args, to_pool


class DecodeRope(NamedTuple):
    """What `decode_attention_fwd` needs to norm, rotate and store a decode step's new tokens itself.

    q is then the raw (un-normed, un-rotated) q. `k`, `v`: the new tokens' raw k and v `[batch, kv_heads, head_dim]`
    (strided views of the q/k/v projection, contiguous last dim); `q_norm`, `k_norm`: Qwen3's per-head RMSNorm
    weights `[head_dim]` with `eps`; `cos_cache`, `sin_cache`: float32 `[max_positions, head_dim // 2]` indexed by
    `positions` `[batch]`; `loc` `[batch]`: each new token's pool slot, the last of its request's KV slots. The pool
    scales are the attention's own `k_scale`/`v_scale`.
    """

    k: torch.Tensor
    v: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    eps: float
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    positions: torch.Tensor
    loc: torch.Tensor

    def check(self, q: torch.Tensor, num_kv_heads: int) -> None:
        """Assert that these inputs fit q `[batch, num_heads, head_dim]` and a pool of `num_kv_heads`."""
        batch, _, head_dim = q.shape
        for name, t in self._asdict().items():
            if isinstance(t, torch.Tensor):
                check_device(name, t, q.device)
        assert head_dim & (head_dim - 1) == 0, f"the fused rotary needs a power-of-2 head_dim, got {head_dim}"
        for name, t in (("k", self.k), ("v", self.v)):
            check_shape(name, t, (batch, num_kv_heads, head_dim))
            check_float(name, t)
            check_last_dim_contiguous(name, t)
        for name, w in (("q_norm", self.q_norm), ("k_norm", self.k_norm)):
            check_shape(name, w, (head_dim,))
            check_float(name, w)
            assert w.is_contiguous(), f"{name} must be contiguous"
        for name, t in (("cos_cache", self.cos_cache), ("sin_cache", self.sin_cache)):
            assert t.dim() == 2 and t.shape[1] == head_dim // 2, (
                f"{name} must be [max_positions, {head_dim // 2}], got {tuple(t.shape)}")
            assert t.dtype == torch.float32, f"{name} must be float32, got {t.dtype}"
            assert t.is_contiguous(), f"{name} must be contiguous"
        check_shape("sin_cache", self.sin_cache, tuple(self.cos_cache.shape))
        for name, t in (("positions", self.positions), ("loc", self.loc)):
            check_index(name, t)
            check_shape(name, t, (batch,))


def split_kernel_args(rope: DecodeRope | None, k_buffer: torch.Tensor, k_scale: float, v_scale: float) -> tuple:
    """The decode split kernel's ROPE-only arguments, in its order (placeholders without `rope`)."""
    if rope is None:
        return (k_buffer,) * 8 + (0,) * 5 + (0.0,) * 4
    inv_k, inv_v, limit, _ = fp8_store_args(k_buffer, k_scale, v_scale)
    return (rope.k, rope.v, rope.q_norm, rope.k_norm, rope.cos_cache, rope.sin_cache, rope.positions, rope.loc,
            rope.k.stride(0), rope.k.stride(1), rope.v.stride(0), rope.v.stride(1), rope.cos_cache.stride(0),
            rope.eps, inv_k, inv_v, limit)


@triton.jit
def rope_cos_sin(cos_ptr, sin_ptr, pos_ptr, req, stride_cache, BLOCK_DH: tl.constexpr):
    """Request `req`'s rotary cos and sin, fp32 `[1, BLOCK_DH]` (BLOCK_DH = head_dim // 2)."""
    pos = tl.load(pos_ptr + req).to(tl.int64)
    offs = tl.arange(0, BLOCK_DH)
    cos = tl.load(cos_ptr + pos * stride_cache + offs)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cache + offs)[None, :]
    return cos, sin


@triton.jit
def _norm_rotate(base, mask, w_ptr, eps, cos, sin, offs, half):
    """Heads at `base` (pointers to their first halves `[rows, BLOCK_DH]`) RMSNorm-ed and rotated, each half
    rounded to the heads' dtype as `_rotary_kernel` stores them."""
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    x1, x2 = _head_rms_norm(x1, x2, w_ptr, eps, half, offs, offs < half, base)
    r1 = (x1 * cos - x2 * sin).to(base.dtype.element_ty)
    r2 = (x2 * cos + x1 * sin).to(base.dtype.element_ty)
    return r1, r2


@triton.jit
def rope_group_q(q_ptr, req, heads, mask_h, stride_q_tok, stride_q_head, w_ptr, eps, cos, sin, half,
                 BLOCK_DH: tl.constexpr):
    """A GQA group's q heads `[BLOCK_H, 2 * BLOCK_DH]` read raw, RMSNorm-ed and rotated (q's dtype; padded rows 0)."""
    offs = tl.arange(0, BLOCK_DH)
    base = q_ptr + req.to(tl.int64) * stride_q_tok + heads[:, None] * stride_q_head + offs[None, :]
    r1, r2 = _norm_rotate(base, mask_h[:, None], w_ptr, eps, cos, sin, offs, half)
    # [BLOCK_H, BLOCK_DH, 2] -> [BLOCK_H, 2, BLOCK_DH] -> the halves side by side
    return tl.reshape(tl.permute(tl.join(r1, r2), (0, 2, 1)), (r1.shape[0], 2 * BLOCK_DH))


@triton.jit
def rope_store_new_kv(k_ptr, v_ptr, req, kv_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                      w_ptr, eps, cos, sin, half, slot, k_buf_ptr, v_buf_ptr, stride_kb_slot, stride_kb_head,
                      stride_vb_slot, stride_vb_head, inv_k_scale, inv_v_scale, fp8_max,
                      IS_FP8: tl.constexpr, EMULATE: tl.constexpr, BLOCK_DH: tl.constexpr):
    """The new token's k head (RMSNorm-ed, rotated) and raw v head into pool row `slot`, as `_rotary_kernel`
    stores them (FP8 pools through the inverse scales)."""
    offs = tl.arange(0, BLOCK_DH)
    req64 = req.to(tl.int64)
    # [1, BLOCK_DH]: one head as a one-row tile
    k_src = k_ptr + req64 * stride_k_tok + kv_head * stride_k_head + offs[None, :]
    k1, k2 = _norm_rotate(k_src, offs[None, :] < half, w_ptr, eps, cos, sin, offs, half)
    kb = k_buf_ptr + slot * stride_kb_slot + kv_head * stride_kb_head + offs[None, :]
    tl.store(kb, to_pool(k1, k_buf_ptr, inv_k_scale, fp8_max, IS_FP8, EMULATE))
    tl.store(kb + half, to_pool(k2, k_buf_ptr, inv_k_scale, fp8_max, IS_FP8, EMULATE))
    v_src = v_ptr + req64 * stride_v_tok + kv_head * stride_v_head + offs[None, :]
    vb = v_buf_ptr + slot * stride_vb_slot + kv_head * stride_vb_head + offs[None, :]
    tl.store(vb, to_pool(tl.load(v_src), v_buf_ptr, inv_v_scale, fp8_max, IS_FP8, EMULATE))
    tl.store(vb + half, to_pool(tl.load(v_src + half), v_buf_ptr, inv_v_scale, fp8_max, IS_FP8, EMULATE))
