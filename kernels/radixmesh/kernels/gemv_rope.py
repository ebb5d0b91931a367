"""Batch-1 q/k/v projection with everything around it in one launch: the residual add and RMSNorm
before it (as `gemv_fused.gemv_add_rmsnorm`), and after it the rotary embedding of q and k and the
store of the new token's k and v into the KV pool (as `fused.apply_rotary_` with a KV store).

The rotation pairs feature `d` of a head with feature `d + head_dim / 2` (neox, rotate-half), so each
program owns `BLOCK_N` rows of the first half of one head and the `BLOCK_N` matching rows of the
second half (the way the gated MLP GEMV owns gate rows and their up rows): the epilogue has both
halves in registers and rotates them without another pass. Heads are laid out q, then k, then v,
as the stacked projection stores them; v rows are stored unrotated. Values are rounded as the
unfused path rounds them: the projection to the activation dtype, then the rotation.

With Qwen3's per-head RMSNorm of q and k (`RopeStore.qk_norm`) a program holds whole heads (`BLOCK_N` is half
a head: the head's rows of both halves), so the head's norm is a reduction in registers before the rotation, rounded
as `fused.apply_rotary_` rounds it (the projection, the normed head, its product with the weight, then the rotation).

Saves one launch per layer (the rotary kernel: ~3 us of an 8B batch-1 step's 32 layers each).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import check_device, check_float, check_index, next_power_of_2
from radixmesh.kernels._fp8_cast import emulate_cast
from radixmesh.kernels._jit import unspecialized
from radixmesh.kernels._pdl import gdc_launch_dependents, gdc_wait, pdl_args
from radixmesh.kernels.fused import QKNorm
from radixmesh.kernels.gemv import TUNED_FUSED, GemvConfig, fused_config
from radixmesh.kernels.gemv_fused import _check_row, _check_weight, _norm_tile, check_addend
from radixmesh.kernels.kv_store import fp8_store_args, to_pool
from radixmesh.kernels.lora_gemv import LoraEpilogue, epilogue_args, lora_epilogue


class RopeStore(NamedTuple):
    """What the epilogue needs: the token's position (`positions` `[1]`), the float32 cos/sin caches
    `[max_positions, head_dim / 2]`, the layer's pool buffers `[slots, kv_heads, head_dim]`, the token's
    slot `loc` `[1]` and the pool's scales (FP8 pools store `k / k_scale`, `v / v_scale`)."""

    positions: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    loc: torch.Tensor
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    k_scale: float = 1.0
    v_scale: float = 1.0
    qk_norm: QKNorm | None = None
    """Qwen3: every q and k head RMSNorm-ed (weights `[head_dim]`) before the rotation."""


@triton.jit
def _head_norm(lo, hi, is_q, is_qk, qw_ptr, kw_ptr, eps, offs_d, y_ptr, HEAD_DIM: tl.constexpr):
    """One head's halves `[HEAD_DIM / 2]` (float32 of the projection rounded to y's dtype) RMSNorm-ed with the q or
    the k weight where `is_qk` (else as they are), rounded as `fused._head_rms_norm` rounds: the normed head, then
    its product with the weight."""
    HALF: tl.constexpr = HEAD_DIM // 2
    act = y_ptr.dtype.element_ty
    rstd = 1.0 / tl.sqrt((tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / HEAD_DIM + eps)
    w_lo = tl.where(is_q, tl.load(qw_ptr + offs_d), tl.load(kw_ptr + offs_d)).to(tl.float32)
    w_hi = tl.where(is_q, tl.load(qw_ptr + HALF + offs_d), tl.load(kw_ptr + HALF + offs_d)).to(tl.float32)
    n_lo = (w_lo * (lo * rstd).to(act).to(tl.float32)).to(act).to(tl.float32)
    n_hi = (w_hi * (hi * rstd).to(act).to(tl.float32)).to(act).to(tl.float32)
    return tl.where(is_qk, n_lo, lo), tl.where(is_qk, n_hi, hi)


@triton.jit(**unspecialized(pointers=("pos_ptr", "loc_ptr")))  # loc: a slice of the slot free list
def _gemv_norm_rope_kernel(x_ptr, r_ptr, nw_ptr, r_out_ptr, w_ptr, s_ptr, add_ptr, y_ptr, K, stride_w, eps,
                           pos_ptr, loc_ptr, cos_ptr, sin_ptr, stride_cache, k_buf_ptr, v_buf_ptr,
                           stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head,
                           inv_k_scale, inv_v_scale, fp8_max, qw_ptr, kw_ptr, qk_eps, xa_ptr, lb_ptr, lslots_ptr,
                           lranks_ptr, lscalings_ptr, ln0, ln1, lsplits, lstride_split, lstride_bs, lstride_bn,
                           HEAD_DIM: tl.constexpr, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                           EVEN: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_ADDEND: tl.constexpr,
                           IS_FP8: tl.constexpr, EMULATE: tl.constexpr, QK_NORM: tl.constexpr,
                           HAS_LORA: tl.constexpr, R: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    pid = tl.program_id(0)
    head = pid // (HALF // BLOCK_N)
    offs_d = (pid % (HALF // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)  # features of the first half
    offs_n = head * HEAD_DIM + offs_d
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    rows_hi = rows + HALF * stride_w
    store_limit = tl.where(pid == 0, K, 0)  # program 0 writes the new residual
    # the first weight tiles are loaded before waiting for the kernel that writes x (radixmesh.kernels._pdl)
    first_mask = offs_k[None, :] < K
    w = tl.load(rows + offs_k[None, :], mask=first_mask, other=0.0, eviction_policy="evict_first")
    w_hi = tl.load(rows_hi + offs_k[None, :], mask=first_mask, other=0.0, eviction_policy="evict_first")
    if PDL and not HAS_LORA:  # with an adapter: before the epilogue (see radixmesh.kernels.gemv)
        gdc_wait()
    squares, h = _norm_tile(x_ptr, r_ptr, nw_ptr, r_out_ptr, offs_k, K, store_limit, HAS_LORA)
    acc = w.to(tl.float32) * h[None, :]
    acc_hi = w_hi.to(tl.float32) * h[None, :]
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=NUM_STAGES):
        cols = k + offs_k
        if EVEN:  # K % BLOCK_K == 0: no mask on the weight tiles (the rows always exist)
            w = tl.load(rows + cols[None, :], eviction_policy="evict_first")
            w_hi = tl.load(rows_hi + cols[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(rows + cols[None, :], mask=cols[None, :] < K, other=0.0, eviction_policy="evict_first")
            w_hi = tl.load(rows_hi + cols[None, :], mask=cols[None, :] < K, other=0.0, eviction_policy="evict_first")
        sq, h = _norm_tile(x_ptr, r_ptr, nw_ptr, r_out_ptr, cols, K, store_limit, HAS_LORA)
        squares += sq
        acc += w.to(tl.float32) * h[None, :]
        acc_hi += w_hi.to(tl.float32) * h[None, :]
    if PDL:
        gdc_launch_dependents()
        if HAS_LORA:
            gdc_wait()
    act = y_ptr.dtype.element_ty
    rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
    lo = tl.sum(acc, axis=1) * rstd
    hi = tl.sum(acc_hi, axis=1) * rstd
    if HAS_SCALE:  # FP8 weights: one scale per output row
        lo = lo * tl.load(s_ptr + offs_n)
        hi = hi * tl.load(s_ptr + offs_n + HALF)
    if HAS_ADDEND:  # a float32 term per weight row (a LoRA adapter's), before the rotation
        lo += tl.load(add_ptr + offs_n)
        hi += tl.load(add_ptr + offs_n + HALF)
    if HAS_LORA:  # the row's adapter on the normed input (radixmesh.kernels.lora_gemv), before the rotation
        n_ok = offs_n >= 0
        lo += rstd * lora_epilogue(xa_ptr, lb_ptr, lslots_ptr, lranks_ptr, lscalings_ptr, offs_n, n_ok, ln0, ln1,
                                   lsplits, lstride_split, lstride_bs, lstride_bn, R, BLOCK_R, BLOCK_S)
        hi += rstd * lora_epilogue(xa_ptr, lb_ptr, lslots_ptr, lranks_ptr, lscalings_ptr, offs_n + HALF, n_ok, ln0,
                                   ln1, lsplits, lstride_split, lstride_bs, lstride_bn, R, BLOCK_R, BLOCK_S)
    lo = lo.to(act).to(tl.float32)  # the projection's output, as the unfused path rounds it
    hi = hi.to(act).to(tl.float32)
    rotate = head < NUM_Q_HEADS + NUM_KV_HEADS  # q and k heads; v heads pass through
    if QK_NORM:  # BLOCK_N == HALF: the whole head is in lo and hi
        lo, hi = _head_norm(lo, hi, head < NUM_Q_HEADS, rotate, qw_ptr, kw_ptr, qk_eps, offs_d, y_ptr, HEAD_DIM)
    pos = tl.load(pos_ptr).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cache + offs_d)
    sin = tl.load(sin_ptr + pos * stride_cache + offs_d)
    out_lo = tl.where(rotate, lo * cos - hi * sin, lo).to(act)
    out_hi = tl.where(rotate, hi * cos + lo * sin, hi).to(act)
    tl.store(y_ptr + offs_n, out_lo)
    tl.store(y_ptr + offs_n + HALF, out_hi)
    slot = tl.load(loc_ptr).to(tl.int64)
    is_k = (head >= NUM_Q_HEADS) & rotate
    is_v = head >= NUM_Q_HEADS + NUM_KV_HEADS
    k_dst = k_buf_ptr + slot * stride_kb_slot + tl.maximum(head - NUM_Q_HEADS, 0) * stride_kb_head + offs_d
    v_dst = (v_buf_ptr + slot * stride_vb_slot + tl.maximum(head - NUM_Q_HEADS - NUM_KV_HEADS, 0) * stride_vb_head
             + offs_d)
    mask_k = offs_d < tl.where(is_k, HALF, 0)
    mask_v = offs_d < tl.where(is_v, HALF, 0)
    tl.store(k_dst, to_pool(out_lo, k_buf_ptr, inv_k_scale, fp8_max, IS_FP8, EMULATE), mask=mask_k)
    tl.store(k_dst + HALF, to_pool(out_hi, k_buf_ptr, inv_k_scale, fp8_max, IS_FP8, EMULATE), mask=mask_k)
    tl.store(v_dst, to_pool(out_lo, v_buf_ptr, inv_v_scale, fp8_max, IS_FP8, EMULATE), mask=mask_v)
    tl.store(v_dst + HALF, to_pool(out_hi, v_buf_ptr, inv_v_scale, fp8_max, IS_FP8, EMULATE), mask=mask_v)


def rope_block_n(cfg: GemvConfig, head_dim: int, qk_norm: bool = False) -> int | None:
    """Rows of each half a program takes (half the configuration's rows), or None when they do not tile
    a half head (with `qk_norm`: when they are not the whole half, a power of two)."""
    half = head_dim // 2
    block = max(1, cfg.block_n // 2)
    fits = half % block == 0 and (block == half or not qk_norm)
    return block if head_dim % 2 == 0 and fits and next_power_of_2(block) == block else None


def rope_config(n: int, k: int, head_dim: int, fp8: bool, qk_norm: bool) -> GemvConfig:
    """The tiles of `gemv_add_rmsnorm_rope` over an `[n, k]` weight: `fused_config`'s, and with `qk_norm` one head a
    program (tuned as kind `rope-norm` where measured, else `head_dim` rows in K tiles of ~8K elements)."""
    if not qk_norm:
        return fused_config("rope", n, k, fp8)
    tuned = TUNED_FUSED.get(("rope-norm", "fp8" if fp8 else "bf16", n, k))
    if tuned is not None and tuned.block_n == head_dim:
        return tuned
    return GemvConfig(head_dim, max(16, min(128, 8192 // max(1, head_dim))), 8 if head_dim >= 128 else 4, 3)


def gemv_add_rmsnorm_rope(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          weight: torch.Tensor, weight_scale: torch.Tensor | None, rope: RopeStore,
                          config: GemvConfig | None = None, addend: torch.Tensor | None = None,
                          lora: LoraEpilogue | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(qkv, x + residual)` for one token: `qkv = rmsnorm(x + residual) * norm_weight @ weight.T` `[1, N]` with
    its q and k heads (RMSNorm-ed first with `rope.qk_norm`) rotated at `rope.positions[0]`, and the rotated k and
    the v written to pool slot `rope.loc[0]`. `weight` `[N, K]` stacks the q, k and v heads
    (`N = (q_heads + 2 kv_heads) * head_dim`), in x's dtype or FP8 with row scales `weight_scale` `[N]` float32.
    `addend` (float32 `[1, N]`, e.g. a LoRA adapter's output) is added to the projection before rounding and the
    rotation, as is the adapter of `lora` (`lora_gemv_shrink` of the same x, residual and norm_weight)."""
    check_float("x", x)
    k = x.shape[-1]
    device = x.device
    _check_row("x", x, k, x.dtype, device)
    _check_row("residual", residual, k, x.dtype, device)
    check_device("norm_weight", norm_weight, device)
    check_float("norm_weight", norm_weight)
    assert tuple(norm_weight.shape) == (k,) and norm_weight.is_contiguous(), (
        f"norm_weight must be a contiguous [{k}], got {tuple(norm_weight.shape)}")
    n = _check_weight(weight, weight_scale, k, device)
    check_addend(addend, n, device)
    lora_args, lora_consts = epilogue_args(lora, n, device, weight)
    if weight_scale is None:
        assert weight.dtype == x.dtype, f"weight is {weight.dtype}, the input is {x.dtype}"
    d, hq, hkv = rope.head_dim, rope.num_q_heads, rope.num_kv_heads
    assert n == (hq + 2 * hkv) * d, (
        f"weight has {n} rows; q/k/v heads {hq}/{hkv}/{hkv} of {d} features need {(hq + 2 * hkv) * d}")
    for name, t in (("positions", rope.positions), ("loc", rope.loc)):
        check_device(name, t, device)
        check_index(name, t)
        assert t.numel() == 1, f"{name} must hold the one token's entry, got {t.numel()}"
    for name, t in (("cos_cache", rope.cos_cache), ("sin_cache", rope.sin_cache)):
        check_device(name, t, device)
        assert t.dtype == torch.float32 and t.is_contiguous() and t.dim() == 2 and t.shape[1] == d // 2, (
            f"{name} must be a contiguous float32 [max_positions, {d // 2}], got {t.dtype} {tuple(t.shape)}")
    for name, t in (("k_buffer", rope.k_buffer), ("v_buffer", rope.v_buffer)):
        check_device(name, t, device)
        assert t.dim() == 3 and tuple(t.shape[1:]) == (hkv, d) and t.stride(2) == 1, (
            f"{name} must be [slots, {hkv}, {d}] with a contiguous last dim, got {tuple(t.shape)}")
    norm = rope.qk_norm
    if norm is not None:
        for name, w in (("q_norm weight", norm.q_weight), ("k_norm weight", norm.k_weight)):
            check_device(name, w, device)
            check_float(name, w)
            assert tuple(w.shape) == (d,) and w.is_contiguous(), (
                f"{name} must be a contiguous [{d}], got {tuple(w.shape)}")
    cfg = config or rope_config(n, k, d, weight_scale is not None, norm is not None)
    block_n = rope_block_n(cfg, d, norm is not None)
    assert block_n is not None, (f"{cfg.block_n} rows a program do not tile head_dim {d} in halves"
                                 + (" (q/k norms: whole heads)" if norm is not None else ""))
    out = torch.empty((1, n), dtype=x.dtype, device=device)
    summed = torch.empty_like(x)
    inv_k, inv_v, limit, is_fp8 = fp8_store_args(rope.k_buffer, rope.k_scale, rope.v_scale)
    grid = ((hq + 2 * hkv) * (d // 2 // block_n),)
    _gemv_norm_rope_kernel[grid](
        x, residual, norm_weight, summed, weight, weight_scale if weight_scale is not None else weight,
        addend if addend is not None else norm_weight, out, k, weight.stride(0), eps, rope.positions, rope.loc,
        rope.cos_cache, rope.sin_cache, rope.cos_cache.stride(0),
        rope.k_buffer, rope.v_buffer, rope.k_buffer.stride(0), rope.k_buffer.stride(1), rope.v_buffer.stride(0),
        rope.v_buffer.stride(1), inv_k, inv_v, limit, *(norm if norm is not None else (norm_weight, norm_weight, 0.0)),
        *lora_args,
        HEAD_DIM=d, NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv, BLOCK_N=block_n, BLOCK_K=cfg.block_k,
        NUM_STAGES=cfg.num_stages, EVEN=k % cfg.block_k == 0, HAS_SCALE=weight_scale is not None,
        HAS_ADDEND=addend is not None, IS_FP8=is_fp8, QK_NORM=norm is not None,
        EMULATE=emulate_cast(device), num_warps=cfg.num_warps, **lora_consts, **pdl_args(device))
    return out, summed
