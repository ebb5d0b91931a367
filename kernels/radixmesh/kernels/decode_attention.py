"""Decode attention: one query token per request over its KV slots (page size 1), split-KV.

Decode is bound by reading K and V. A batch of few long requests would leave most SMs
idle with one program per (request, KV head), so each request's sequence is cut into
up to `num_kv_splits` chunks, processed in parallel:

- stage 1, grid (kv_heads, batch, num_kv_splits): one program takes every query head
  that shares a KV head (GQA group, padded to >= 16 rows for `tl.dot`), streams its
  chunk's K/V tiles once for the whole group, and writes a normalized partial output
  and its log-sum-exp (base 2) to scratch. KV heads vary fastest, so the programs of
  one request's heads run side by side and read neighbouring bytes of the same slots
  (each slot's heads are one contiguous row): 1-5% faster than request-major at batches 112-168
  on an H100, the same at small batches;
- stage 2, grid (batch, heads): merges a request's chunks, weighting each by exp(lse).
  With one split (a large batch already fills the GPU) stage 1 writes the output itself and
  stage 2 is not launched.

The chunk length is decided on the device from the request's own length
(`ceil(seq_len / num_kv_splits)` rounded up to the KV tile), so a short request only
uses a few of the launched splits and the launch shape depends on host ints alone:
fixed `num_kv_splits` and scratch buffers make the pair CUDA-graph capturable.

Qwen3 decode steps (`rope`, the `ROPE` path): a batch-1 step is bound by launch latency (~3 us per dependent
launch under PDL), so the split kernel also does the rotary launch's work, one launch fewer per layer. q is read
raw from the q/k/v projection; every program RMSNorms its GQA group's q heads and rotates them in registers, rounding
as `fused.apply_rotary_` does (`radixmesh.kernels.decode_rope`), and q is not written back. The one program per
(request, KV head) whose split holds position seq_len - 1 (the new token, at slot `loc`, the request's last slot)
norms and rotates the new k head and stores it and the raw v head into the pool, then passes a CTA barrier so
its own K/V loop reads that row; no other program reads it. All of it comes after the PDL wait.

FP8 pools: tiles are widened in registers; `k_scale` is folded into the softmax scale and `v_scale`
multiplies each split's output, so the loop does no extra work per element. How a tile is widened is
`fp8_widen`: `f32` (e4m3 -> float32 -> the dot dtype, exact for every q dtype), `direct` (e4m3 -> the dot
dtype in one Triton cast) or `f16` (e4m3 -> float16, one native conversion per pair on sm_89+, with both
dots in float16: q is saturated to +-65504 first, far beyond what attention queries reach, and the
probabilities keep more mantissa than in bf16).
"""

from __future__ import annotations

import math

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
    dot_dtype,
    dot_precision,
    next_power_of_2,
)
from radixmesh.kernels._fp8_cast import emulate_cast
from radixmesh.kernels._jit import unspecialized
from radixmesh.kernels._pdl import gdc_launch_dependents, gdc_wait, pdl_args
from radixmesh.kernels.decode_rope import (
    DecodeRope,
    rope_cos_sin,
    rope_group_q,
    rope_store_new_kv,
    split_kernel_args,
)

LOG2E = 1.4426950408889634
DEFAULT_MAX_KV_SPLITS = 64
# below this many tokens per split, another split costs more (partial writes, merge) than it saves
MIN_TOKENS_PER_SPLIT = 256
# programs per SM to aim for before splitting stops paying: many programs resident per SM hide
# the uneven lengths of a batch's requests (H100 sweep, batches 48-168 of 256-6,144 tokens)
_PROGRAMS_PER_SM = 16
_CPU_NUM_SMS = 4
FP8_WIDENS = ("f32", "direct", "f16")
"""How an FP8 pool's K/V tiles become `tl.dot` operands (see the module docstring)."""


@triton.jit
def _widen(x, OP_DTYPE: tl.constexpr, KV_FP8: tl.constexpr, THROUGH_F32: tl.constexpr):
    """A K/V tile as the dots' operand dtype (FP8: through float32, or in one cast)."""
    if KV_FP8 and THROUGH_F32:
        x = x.to(tl.float32)
    return x.to(OP_DTYPE)


@triton.jit(**unspecialized(pointers=("pos_ptr", "loc_ptr")))  # loc: a slice of the slot free list
def _decode_split_kernel(
    q_ptr, k_buf_ptr, v_buf_ptr, kv_indptr_ptr, kv_lens_ptr, kv_indices_ptr, mid_o_ptr, mid_lse_ptr, o_ptr,
    qk_scale, v_scale, num_kv_splits,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head,
    stride_mo_req, stride_mo_head, stride_mo_split, stride_ml_req, stride_ml_head,
    head_dim,
    # ROPE only: the new tokens' raw k/v, q/k norm weights, rotary tables, positions and slots
    k_new_ptr, v_new_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, loc_ptr,
    stride_kn_tok, stride_kn_head, stride_vn_tok, stride_vn_head, stride_cache,
    eps, inv_k_scale, inv_v_scale, fp8_max,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr,
    HEAD_MAJOR: tl.constexpr, DIRECT: tl.constexpr, THROUGH_F32: tl.constexpr, Q_CLAMP: tl.constexpr,
    HAS_LENS: tl.constexpr, ROPE: tl.constexpr, EMULATE: tl.constexpr,
):
    if HEAD_MAJOR:  # grid (kv_heads, batch, splits): a request's KV heads are dispatched side by side
        kv_head = tl.program_id(0)
        req = tl.program_id(1)
    else:
        req = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:  # q and the new token's K/V come from the kernel before (radixmesh.kernels._pdl)
        gdc_wait()

    kv_start = tl.load(kv_indptr_ptr + req).to(tl.int64)
    if HAS_LENS:  # ranges given as (start, length): rows may share slots (a verify pass's tokens)
        seq_len = tl.load(kv_lens_ptr + req).to(tl.int64)
    else:
        seq_len = tl.load(kv_indptr_ptr + req + 1).to(tl.int64) - kv_start
    split_len = tl.cdiv(tl.cdiv(seq_len, num_kv_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_g
    mask_h = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    if ROPE:  # q arrives raw: norm and rotate it here; the new token's K/V is stored by its split's program
        half = head_dim // 2
        cos, sin = rope_cos_sin(cos_ptr, sin_ptr, pos_ptr, req, stride_cache, BLOCK_D // 2)
        # [BLOCK_H, BLOCK_D]: the group's query heads, as `apply_rotary_` would have left them; padded rows are zero
        q = rope_group_q(q_ptr, req, heads, mask_h, stride_q_tok, stride_q_head, qw_ptr, eps, cos, sin, half,
                         BLOCK_D // 2)
        if (lo < hi) & (hi == seq_len):  # this split holds position seq_len - 1, the new token
            slot = tl.load(loc_ptr + req).to(tl.int64)
            rope_store_new_kv(k_new_ptr, v_new_ptr, req, kv_head, stride_kn_tok, stride_kn_head, stride_vn_tok,
                              stride_vn_head, kw_ptr, eps, cos, sin, half, slot, k_buf_ptr, v_buf_ptr,
                              stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head, inv_k_scale,
                              inv_v_scale, fp8_max, KV_FP8, EMULATE, BLOCK_D // 2)
            tl.debug_barrier()  # the program's own K/V loop reads that row next
    else:
        # [BLOCK_H, BLOCK_D]: the group's query heads; padded rows are zero
        q = tl.load(q_ptr + req.to(tl.int64) * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    if Q_CLAMP:  # float16 dots over a wider q: saturate instead of overflowing to inf
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0)
    q = q.to(DOT_DTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    k_base = k_buf_ptr + kv_head * stride_kb_head
    v_base = v_buf_ptr + kv_head * stride_vb_head
    for n in range(lo, hi, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slots = tl.load(kv_indices_ptr + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        mask_kv = mask_n[:, None] & mask_d[None, :]
        # [BLOCK_N, BLOCK_D]
        k = tl.load(k_base + slots[:, None] * stride_kb_slot + offs_d[None, :], mask=mask_kv, other=0.0)
        # [BLOCK_H, BLOCK_N], in log2 units
        s = tl.dot(q, tl.trans(_widen(k, DOT_DTYPE, KV_FP8, THROUGH_F32)), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slots[:, None] * stride_vb_slot + offs_d[None, :], mask=mask_kv, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), _widen(v, DOT_DTYPE, KV_FP8, THROUGH_F32),
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    if PDL:
        gdc_launch_dependents()

    # an empty split (past the end of a short request) writes lse = -inf and a zero partial
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None] * v_scale
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    req64 = req.to(tl.int64)
    if DIRECT:  # one split: its normalized output is the answer, no merge pass
        tl.store(o_ptr + req64 * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
        return
    tl.store(mid_o_ptr + req64 * stride_mo_req + heads[:, None] * stride_mo_head + split * stride_mo_split
             + offs_d[None, :], out, mask=mask_h[:, None] & mask_d[None, :])
    tl.store(mid_lse_ptr + req64 * stride_ml_req + heads * stride_ml_head + split, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    kv_indptr_ptr, kv_lens_ptr, mid_o_ptr, mid_lse_ptr, o_ptr,
    num_kv_splits,
    stride_mo_req, stride_mo_head, stride_mo_split, stride_ml_req, stride_ml_head,
    stride_o_tok, stride_o_head,
    head_dim,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr, HAS_LENS: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if HAS_LENS:
        seq_len = tl.load(kv_lens_ptr + req).to(tl.int64)
    else:
        seq_len = tl.load(kv_indptr_ptr + req + 1).to(tl.int64) - tl.load(kv_indptr_ptr + req).to(tl.int64)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_kv_splits), BLOCK_N) * BLOCK_N

    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    has_keys = (offs_s < num_kv_splits) & (offs_s * split_len < seq_len)
    req64 = req.to(tl.int64)
    # [BLOCK_S]
    lse = tl.load(mid_lse_ptr + req64 * stride_ml_req + head * stride_ml_head + offs_s, mask=has_keys,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a request with no keys: weights all 0, output 0
    w = tl.where(has_keys, tl.exp2(lse - m), 0.0)
    # [BLOCK_S, BLOCK_D]
    part = tl.load(mid_o_ptr + req64 * stride_mo_req + head * stride_mo_head + offs_s[:, None] * stride_mo_split
                   + offs_d[None, :], mask=has_keys[:, None] & mask_d[None, :], other=0.0)
    denom = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(o_ptr + req64 * stride_o_tok + head * stride_o_head + offs_d, out.to(o_ptr.dtype.element_ty),
             mask=mask_d)


class DecodeScratch:
    """Reusable stage-1 outputs: flat fp32 buffers viewed per launch as
    mid_out `[batch, num_heads, num_kv_splits, head_dim]` (normalized partial outputs) and
    mid_lse `[batch, num_heads, num_kv_splits]` (base-2 log-sum-exp of each split).

    Sized by element count, so one buffer serves a large batch with few splits and a small
    batch with many; views need no allocation, so launches stay CUDA-graph capturable.
    """

    def __init__(self, max_rows: int, head_dim: int, device: torch.device | str) -> None:
        assert max_rows > 0 and head_dim > 0, f"scratch sizes must be positive: rows {max_rows}, head_dim {head_dim}"
        self.max_rows = max_rows  # batch * num_heads * num_kv_splits it can hold
        self.head_dim = head_dim
        self.mid_out = torch.empty(max_rows * head_dim, dtype=torch.float32, device=device)
        self.mid_lse = torch.empty(max_rows, dtype=torch.float32, device=device)
        self._views: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def allocate(cls, max_batch: int, num_heads: int, head_dim: int, max_kv_splits: int,
                 device: torch.device | str) -> DecodeScratch:
        return cls(max_batch * num_heads * max_kv_splits, head_dim, device)

    def fits(self, batch: int, num_heads: int, head_dim: int, num_kv_splits: int) -> bool:
        return head_dim == self.head_dim and batch * num_heads * num_kv_splits <= self.max_rows

    def views(self, batch: int, num_heads: int, head_dim: int,
              num_kv_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.fits(batch, num_heads, head_dim, num_kv_splits), (
            f"scratch of {self.max_rows} rows x head_dim {self.head_dim} does not fit batch {batch}, "
            f"heads {num_heads}, splits {num_kv_splits}, head_dim {head_dim}")
        key = (batch, num_heads, num_kv_splits)
        views = self._views.get(key)
        if views is None:  # cached: slicing costs host time on every layer of every step
            rows = batch * num_heads * num_kv_splits
            views = (self.mid_out[:rows * head_dim].view(batch, num_heads, num_kv_splits, head_dim),
                     self.mid_lse[:rows].view(batch, num_heads, num_kv_splits))
            self._views[key] = views
        return views


def get_num_sms(device: torch.device | str) -> int:
    """Streaming multiprocessors of a CUDA device; a small constant on CPU (the interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return _CPU_NUM_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def choose_num_kv_splits(batch_size: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                         max_kv_splits: int = DEFAULT_MAX_KV_SPLITS) -> int:
    """Splits per request: ~16 programs per SM, but >= 256 tokens per split.

    All host ints (e.g. `max(seq_lens_cpu)`), so choosing needs no device sync.
    """
    assert batch_size > 0 and num_kv_heads > 0 and num_sms > 0 and max_kv_splits > 0
    programs_per_split = batch_size * num_kv_heads
    by_occupancy = math.ceil(_PROGRAMS_PER_SM * num_sms / programs_per_split)
    by_length = math.ceil(max(max_seq_len, 1) / MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, max_kv_splits))


def _block_sizes(head_dim: int, kv_fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for stage 1.

    An H100 sweep (BLOCK_N 32/64/128, 4/8 warps, 2-4 stages; batch 1-64, 2K-32K tokens, GQA 4/8)
    put (64, 4, 2) within ~3% of the best everywhere: the loop is bound by HBM, not by the tile.
    FP8 pools read half the bytes per row: an H200 sweep (24 tiles x widenings at batches 64 and 256,
    lengths 256-6,144; docs/benchmarks) put (128, 4, 3) first, 1.77x faster than (64, 4, 2) over both.
    """
    block_d = next_power_of_2(head_dim)
    if block_d >= 256:
        return 32, 4, 2
    if kv_fp8:
        return 128, 4, 3
    return 64, 4, 2


def decode_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor,
                         kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float, num_kv_splits: int,
                         scratch: DecodeScratch | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                         tiles: tuple[int, int, int] | None = None, head_major: bool = True,
                         fp8_widen: str = "f32", kv_lens: torch.Tensor | None = None,
                         rope: DecodeRope | None = None) -> None:
    """Attention of one query per request over its KV, written to `out`.

    q, out: `[batch, num_heads, head_dim]`; k_buffer, v_buffer: `[num_slots, kv_heads, head_dim]`;
    request i attends to slots `kv_indices[kv_indptr[i]:kv_indptr[i + 1]]` (`kv_indptr` `[batch + 1]`).
    `num_kv_splits` (host int, e.g. from `choose_num_kv_splits`) is the launched split count; a
    request uses fewer when it is short. `scratch` must fit (batch, heads, head_dim, num_kv_splits);
    without it, scratch is allocated per call (not CUDA-graph safe). No host sync.
    FP8 buffers hold `k / k_scale` and `v / v_scale` (`kv_store.store_kv`); the kernels read them back
    through the same scales. `tiles` (BLOCK_N, num_warps, num_stages) and `head_major` (the grid's order)
    are for benchmarks and tuning: the defaults are the measured best. `fp8_widen` (one of FP8_WIDENS) is how
    an FP8 pool's tiles become dot operands; ignored for other pools.
    `kv_lens` (`[batch]`): query i attends to `kv_indices[kv_indptr[i]:kv_indptr[i] + kv_lens[i]]` instead, so
    ranges may overlap: the tokens of a short extend (a verify pass) each read a prefix of their request's slots.
    `rope` (decode passes only, not with `kv_lens`): q is the raw q of the q/k/v projection, and the kernel does
    `apply_rotary_`'s work with its KV store and q/k norms itself (the same bits); the new token's slot `rope.loc[i]`
    must be request i's last slot. q is not written back.
    """
    _check_decode_args(q, k_buffer, v_buffer, out, kv_indptr, kv_indices, num_kv_splits)
    if rope is not None:
        assert kv_lens is None, "rope is for decode passes (one new token per request), not with kv_lens"
        rope.check(q, k_buffer.shape[1])
    if kv_lens is not None:
        check_device("kv_lens", kv_lens, q.device)
        check_index("kv_lens", kv_lens)
        assert kv_lens.shape[0] >= q.shape[0], f"kv_lens has {kv_lens.shape[0]} entries, need {q.shape[0]}"
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if batch == 0:
        return
    if scratch is None:
        scratch = DecodeScratch.allocate(batch, num_heads, head_dim, num_kv_splits, q.device)
    check_device("scratch.mid_out", scratch.mid_out, q.device)
    mid_o, mid_lse = scratch.views(batch, num_heads, head_dim, num_kv_splits)

    group = num_heads // num_kv_heads
    assert fp8_widen in FP8_WIDENS, f"fp8_widen must be one of {FP8_WIDENS}, got {fp8_widen!r}"
    kv_fp8 = k_buffer.dtype in FP8_DTYPES
    operand_dtype = tl.float16 if kv_fp8 and fp8_widen == "f16" else dot_dtype(q.dtype, q.device)
    block_d = next_power_of_2(head_dim)
    block_n, num_warps, num_stages = tiles or _block_sizes(head_dim, kv_fp8)
    assert block_n >= 16 and block_n & (block_n - 1) == 0, f"BLOCK_N must be a power of 2 >= 16, got {block_n}"
    grid = (num_kv_heads, batch, num_kv_splits) if head_major else (batch, num_kv_heads, num_kv_splits)
    _decode_split_kernel[grid](
        q, k_buffer, v_buffer, kv_indptr, kv_lens if kv_lens is not None else kv_indptr, kv_indices, mid_o, mid_lse,
        out, sm_scale * LOG2E * k_scale, v_scale, num_kv_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        head_dim, *split_kernel_args(rope, k_buffer, k_scale, v_scale),
        GROUP=group, BLOCK_H=max(16, next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        DOT_DTYPE=operand_dtype, DOT_PRECISION=dot_precision(operand_dtype), KV_FP8=kv_fp8,
        HEAD_MAJOR=head_major, DIRECT=num_kv_splits == 1, THROUGH_F32=fp8_widen == "f32",
        Q_CLAMP=operand_dtype == tl.float16 and q.dtype != torch.float16, HAS_LENS=kv_lens is not None,
        ROPE=rope is not None, EMULATE=rope is not None and kv_fp8 and emulate_cast(q.device),
        num_warps=num_warps, num_stages=num_stages, **pdl_args(q.device),
    )
    if num_kv_splits == 1:
        return
    _decode_merge_kernel[(batch, num_heads)](
        kv_indptr, kv_lens if kv_lens is not None else kv_indptr, mid_o, mid_lse, out,
        num_kv_splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        head_dim,
        BLOCK_S=next_power_of_2(num_kv_splits), BLOCK_D=block_d, BLOCK_N=block_n, HAS_LENS=kv_lens is not None,
        num_warps=4 if block_d >= 128 else 2, **pdl_args(q.device),
    )


def _check_decode_args(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor,
                       kv_indptr: torch.Tensor, kv_indices: torch.Tensor, num_kv_splits: int) -> None:
    device = q.device
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("out", out),
                    ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        check_device(name, t, device)
    assert q.dim() == 3, f"q must be [batch, num_heads, head_dim], got {tuple(q.shape)}"
    assert k_buffer.dim() == 3, f"k_buffer must be [num_slots, kv_heads, head_dim], got {tuple(k_buffer.shape)}"
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    assert k_buffer.shape[2] == head_dim, f"k_buffer head_dim {k_buffer.shape[2]} != q head_dim {head_dim}"
    check_shape("v_buffer", v_buffer, tuple(k_buffer.shape))
    check_shape("out", out, tuple(q.shape))
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} is not a multiple of kv_heads {num_kv_heads}"
    assert head_dim >= 16, f"head_dim {head_dim} < 16 is not supported (tl.dot needs K >= 16)"
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("out", out)):
        (check_kv if "buffer" in name else check_float)(name, t)
        check_last_dim_contiguous(name, t)
    assert v_buffer.dtype == k_buffer.dtype, f"v_buffer is {v_buffer.dtype}, k_buffer is {k_buffer.dtype}"
    check_index("kv_indptr", kv_indptr)
    check_index("kv_indices", kv_indices)
    assert kv_indptr.shape[0] >= batch + 1, f"kv_indptr has {kv_indptr.shape[0]} entries, need batch + 1 = {batch + 1}"
    assert num_kv_splits >= 1, f"num_kv_splits must be >= 1, got {num_kv_splits}"
