"""The attention half of a one-token decoder layer in one persistent launch: the input add + RMSNorm, the q/k/v
projection, (Qwen3: the per-head q/k RMSNorm,) the rotary and the new token's K/V store, split-KV attention over
the request's slots, the merge of the splits and the o projection.

    out, summed = attn_block_decode(x, residual, norm_w, eps, w_qkv, w_o, rope, k_buf, v_buf, kv_indptr,
                                    kv_indices, sm_scale, workspace)

At batch 1 today's launches for this half (`gemv_add_rmsnorm` for q/k/v, the decode split kernel with the
rotary, its merge, the o GEMV) each wait for the one before to end and ramp up again: on an H200 a Qwen3-30B-A3B
layer spends ~22 us in them for ~38 MB of weights (~9.3 us at the copy rate). Here a grid of P programs, all
resident (a few per SM), runs four phases separated by grid barriers (`moe_block._grid_barrier`):

1. q/k/v: each program norms the row itself (a few KB) and streams its share of the projection's row tiles
   into the workspace's raw `qkv` (rounded to the activations' dtype); program 0 writes `summed`.
2. attention: units (KV head, split), each a GQA group's q heads normed and rotated in registers over one chunk
   of the request's slots, as the decode split kernel does (the unit holding the last position first norms,
   rotates and stores the new token's k and v); each writes its normalized partial output and log-sum-exp.
3. merge: one unit per q head, the splits weighted by their log-sum-exp, into the workspace's `attn` row.
4. o: its share of the o projection's row tiles over `attn`, into `out`.

A split's chunk length is decided on the device from the request's length (as the decode split kernel decides
it), so the launch depends on host ints alone and a CUDA graph captures it. Data another program wrote in this
launch is read only after a barrier's acquire, with `.cg` loads (L2, not the SM's own L1). Under the interpreter
(CPU) P = 1 and every barrier passes at once.

Measured on an H200 (Qwen3-30B-A3B's attention, 1,024 slots; benchmarks, 2026-12-01 second stop): 25.9-26.1 us a
layer against 25.1 for today's launches with PDL, and in the model batch-1 decode ran at 352.4 tok/s against 392.1,
so the model takes it only with RADIXMESH_ATTN_BLOCK=on. Where the time goes (`bench_attn_block --trace`): q/k/v
9.5 us for 21 MB, a barrier ~1 us, attention 5.1 us for 2 MB of K/V (a chain of dependent loads), the merge 1.3,
o 5.4 us for 16.8 MB. Reads ahead were tried and removed, each slower (3dcacde, 5bb2d5e): a unit's K/V and the o
rows held in registers (fewer programs an SM keeps), the q/k/v and o rows asked of L2 (the phase issuing them
slowed more than the one reading them gained).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import check_device, check_index, dot_dtype, dot_precision, next_power_of_2
from radixmesh.kernels._occupancy import resident_programs
from radixmesh.kernels._pdl import gdc_launch_dependents, gdc_wait, pdl_args
from radixmesh.kernels.decode_rope import rope_cos_sin
from radixmesh.kernels.fused import _head_rms_norm
from radixmesh.kernels.gemv_norm_out import MAX_ROW, _normed_tile
from radixmesh.kernels.moe_block import SPIN_POLLS, _grid_barrier, _grid_exit, _stamp

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""float32: the CPU tests (under the interpreter); a GPU serves bf16 or fp16."""
LOG2E = 1.4426950408889634
TRACE_POINTS = ("entry", "qkv", "barrier1", "attention", "barrier2", "merge", "barrier3", "o")
"""Where a traced launch stamps each program's clocks (`attn_block_decode(trace=...)`)."""


@dataclass(frozen=True)
class AttnBlockConfig:
    """Tiles, splits and programs per SM of `attn_block_decode`."""

    qkv_block_r: int = 4
    """q/k/v rows per unit."""
    qkv_block_k: int = 512
    """q/k/v reduction step."""
    o_block_r: int = 4
    """o rows per unit."""
    o_block_k: int = 512
    """o reduction step."""
    num_stages: int = 3
    """Loads in flight in the GEMV loops."""
    num_splits: int = 32
    """KV chunks per KV head, at most the workspace's (a short request uses fewer: at least `block_n` slots
    each)."""
    block_n: int = 16
    """Slots per attention tile."""
    num_warps: int = 4
    ctas_per_sm: int = 4
    """Programs per SM (P = SMs x this), lowered by the launcher to what fits."""

    def __post_init__(self) -> None:
        for name in ("qkv_block_r", "qkv_block_k", "o_block_r", "o_block_k", "block_n"):
            value = getattr(self, name)
            assert value >= 1 and value & (value - 1) == 0, f"{name} must be a power of 2, got {value}"
        assert self.block_n >= 16, f"block_n must be >= 16 (tl.dot): {self}"
        assert 1 <= self.num_stages <= 8 and 1 <= self.num_splits <= 1024, f"bad stages or splits: {self}"
        assert self.num_warps in (1, 2, 4, 8, 16) and 1 <= self.ctas_per_sm <= 32, f"bad warps or CTAs: {self}"


class BlockRope(NamedTuple):
    """The rotary inputs of one decode token: Qwen3's q/k RMSNorm weights `[head_dim]` (None: no q/k norm) with
    `eps`, float32 `cos_cache`/`sin_cache` `[max_positions, head_dim // 2]`, `positions` `[1]` and `loc` `[1]`
    (the new token's pool slot, the request's last)."""

    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    positions: torch.Tensor
    loc: torch.Tensor


@dataclass(frozen=True)
class AttnBlockWorkspace:
    """What the programs of one launch share, allocated once (a CUDA graph replays over it); the layers of one
    stream share it (every launch leaves the counters at 0)."""

    sync: torch.Tensor  # int32 [3]: barrier arrivals, exits, error flag
    qkv: torch.Tensor  # [(Hq + 2 Hkv) * D] raw q/k/v, activations' dtype
    mid_o: torch.Tensor  # float32 [splits, Hq, D]: each split's normalized partial output
    mid_lse: torch.Tensor  # float32 [splits, Hq]: its base-2 log-sum-exp
    attn: torch.Tensor  # [Hq * D]: the merged attention row

    @classmethod
    def allocate(cls, num_heads: int, num_kv_heads: int, head_dim: int, num_splits: int, dtype: torch.dtype,
                 device: torch.device) -> AttnBlockWorkspace:
        assert num_heads >= 1 and num_kv_heads >= 1 and num_heads % num_kv_heads == 0 and num_splits >= 1, (
            f"bad block: {num_heads} heads, {num_kv_heads} KV heads, {num_splits} splits")
        rows = (num_heads + 2 * num_kv_heads) * head_dim
        return cls(torch.zeros(3, dtype=torch.int32, device=device), torch.zeros(rows, dtype=dtype, device=device),
                   torch.zeros(num_splits, num_heads, head_dim, dtype=torch.float32, device=device),
                   torch.zeros(num_splits, num_heads, dtype=torch.float32, device=device),
                   torch.zeros(num_heads * head_dim, dtype=dtype, device=device))

    def timed_out(self) -> bool:
        """Whether a barrier wait ever gave up (the grid was not co-resident; outputs since are garbage). Syncs."""
        return bool(self.sync[2].item())


# ---- the kernel -----------------------------------------------------------------------------------------

@triton.jit
def _gemv_rows(w_ptr, y_ptr, in_ptr, x_ptr, r_ptr, nw_ptr, rstd, pid, P, N: tl.constexpr, K: tl.constexpr,
               NORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """`y[rows] = w[rows] @ v` over this program's row tiles, v the normed row (NORM: `_normed_tile` of x + r)
    or `in_ptr`'s row (written in this launch: `.cg` loads); one flattened loop over (tile, K step) with the
    tile's store under an `if` at its last step, so the next tile's loads do not wait for it."""
    act = y_ptr.dtype.element_ty
    R_TILES: tl.constexpr = (N + BLOCK_R - 1) // BLOCK_R
    K_TILES: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for t in tl.range(pid * R_TILES // P * K_TILES, (pid + 1) * R_TILES // P * K_TILES, num_stages=NUM_STAGES):
        tile = t // K_TILES
        k = (t - tile * K_TILES) * BLOCK_K
        rows = tile * BLOCK_R + offs_r
        src = tl.where(rows < N, rows, N - 1).to(tl.int64)  # tail rows repeat the last (not stored)
        cols = k + offs_k
        if K % BLOCK_K == 0:
            w = tl.load(w_ptr + src[:, None] * K + cols[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(w_ptr + src[:, None] * K + cols[None, :], mask=(cols < K)[None, :], other=0.0,
                        eviction_policy="evict_first")
        if NORM:
            v = _normed_tile(x_ptr, r_ptr, nw_ptr, y_ptr, cols, K, rstd)
        else:
            v = tl.load(in_ptr + cols, mask=cols < K, other=0.0, cache_modifier=".cg").to(tl.float32)
        acc += w.to(tl.float32) * v[None, :]
        if k == (K_TILES - 1) * BLOCK_K:
            tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(act), mask=rows < N)
            acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)


@triton.jit
def _norm_rotate(ptrs, mask, w_ptr, eps, cos, sin, half, offs, QK_NORM: tl.constexpr):
    """Heads at `ptrs` (their first halves `[rows, half]`, written in this launch) RMSNorm-ed (QK_NORM) and
    rotated, each half rounded to their dtype as `fused.apply_rotary_` stores them."""
    x1 = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    x2 = tl.load(ptrs + half, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    if QK_NORM:
        x1, x2 = _head_rms_norm(x1, x2, w_ptr, eps, half, offs, offs < half, ptrs)
    dtype = ptrs.dtype.element_ty
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)


@triton.jit
def _store_new_kv(qkv_ptr, k_buf_ptr, v_buf_ptr, slot, kv_head, kw_ptr, eps, cos, sin, stride_kb_slot,
                  stride_kb_head, stride_vb_slot, stride_vb_head, HQ: tl.constexpr, HKV: tl.constexpr,
                  D: tl.constexpr, QK_NORM: tl.constexpr):
    """The new token's k head (normed, rotated) and raw v head into pool row `slot`."""
    half: tl.constexpr = D // 2
    offs = tl.arange(0, half)
    k_src = qkv_ptr + (HQ + kv_head) * D + offs[None, :]  # [1, half]: one head as a one-row tile
    k1, k2 = _norm_rotate(k_src, offs[None, :] < half, kw_ptr, eps, cos, sin, half, offs, QK_NORM)
    k_row = tl.reshape(tl.permute(tl.join(k1, k2), (0, 2, 1)), (1, D)).to(k_buf_ptr.dtype.element_ty)
    offs_d = tl.arange(0, D)
    tl.store(k_buf_ptr + slot * stride_kb_slot + kv_head * stride_kb_head + offs_d[None, :], k_row)
    v_row = tl.load(qkv_ptr + (HQ + HKV + kv_head) * D + offs_d[None, :], cache_modifier=".cg").to(
        v_buf_ptr.dtype.element_ty)
    tl.store(v_buf_ptr + slot * stride_vb_slot + kv_head * stride_vb_head + offs_d[None, :], v_row)


@triton.jit
def _kv_tile(k_buf_ptr, v_buf_ptr, kv_indices_ptr, kv_start, n, hi, kv_head, stride_kb_slot, stride_kb_head,
             stride_vb_slot, stride_vb_head, D: tl.constexpr, BLOCK: tl.constexpr):
    """K and V `[BLOCK, D]` of positions n .. n + BLOCK (those < hi; the others 0) of one KV head."""
    offs_n = n + tl.arange(0, BLOCK)
    mask_n = offs_n < hi
    slots = tl.load(kv_indices_ptr + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
    offs_d = tl.arange(0, D)
    k = tl.load(k_buf_ptr + kv_head * stride_kb_head + slots[:, None] * stride_kb_slot + offs_d[None, :],
                mask=mask_n[:, None], other=0.0)
    v = tl.load(v_buf_ptr + kv_head * stride_vb_head + slots[:, None] * stride_vb_slot + offs_d[None, :],
                mask=mask_n[:, None], other=0.0)
    return k, v


@triton.jit
def _attend(q, k, v, mask_n, m_i, l_i, acc, qk_scale, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One K/V tile into the running softmax `(m_i, l_i, acc)` of the group's q rows (base-2 scores)."""
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attention_units(qkv_ptr, k_buf_ptr, v_buf_ptr, kv_start, seq_len, split_len, kv_indices_ptr, mid_o_ptr,
                     mid_lse_ptr, qw_ptr, kw_ptr, qk_eps, cos, sin, slot, qk_scale, pid, P,
                     stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head, S,
                     HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_N: tl.constexpr, QK_NORM: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """Phase 2: units (KV head, split) pid, pid + P, ...; empty splits (past the request's end) write nothing."""
    GROUP: tl.constexpr = HQ // HKV
    half: tl.constexpr = D // 2
    offs_g = tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    offs_half = tl.arange(0, half)
    offs_d = tl.arange(0, D)
    for u in range(pid, HKV * S, P):
        kv_head = u % HKV
        split = u // HKV
        lo = split * split_len
        hi = tl.minimum(lo + split_len, seq_len)
        if lo < hi:
            heads = kv_head * GROUP + offs_g
            q_src = qkv_ptr + tl.where(mask_h, heads, 0)[:, None] * D + offs_half[None, :]
            r1, r2 = _norm_rotate(q_src, mask_h[:, None], qw_ptr, qk_eps, cos, sin, half, offs_half, QK_NORM)
            # [BLOCK_H, half, 2] -> [BLOCK_H, 2, half] -> the halves side by side; padded rows are zero
            q = tl.reshape(tl.permute(tl.join(r1, r2), (0, 2, 1)), (BLOCK_H, D)).to(DOT_DTYPE)
            if hi == seq_len:  # this unit holds the new token: store its k and v before reading the slot
                _store_new_kv(qkv_ptr, k_buf_ptr, v_buf_ptr, slot, kv_head, kw_ptr, qk_eps, cos, sin, stride_kb_slot,
                              stride_kb_head, stride_vb_slot, stride_vb_head, HQ, HKV, D, QK_NORM)
                tl.debug_barrier()
            m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
            acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
            for n in range(lo, hi, BLOCK_N):
                k, v = _kv_tile(k_buf_ptr, v_buf_ptr, kv_indices_ptr, kv_start, n, hi, kv_head, stride_kb_slot,
                                stride_kb_head, stride_vb_slot, stride_vb_head, D, BLOCK_N)
                m_i, l_i, acc = _attend(q, k, v, n + tl.arange(0, BLOCK_N) < hi, m_i, l_i, acc, qk_scale,
                                        DOT_DTYPE, DOT_PRECISION)
            out = acc / l_i[:, None]  # (l_i > 0: the unit has at least one slot)
            tl.store(mid_o_ptr + (split * HQ + heads)[:, None] * D + offs_d[None, :], out, mask=mask_h[:, None])
            tl.store(mid_lse_ptr + split * HQ + heads, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit
def _merge_units(mid_o_ptr, mid_lse_ptr, attn_ptr, seq_len, split_len, pid, P, S, HQ: tl.constexpr,
                 D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Phase 3: q heads pid, pid + P, ...: the splits that hold slots, weighted by exp2(lse), into `attn`."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    has_keys = (offs_s < S) & (offs_s * split_len < seq_len)
    for head in range(pid, HQ, P):
        lse = tl.load(mid_lse_ptr + offs_s * HQ + head, mask=has_keys, other=float("-inf"), cache_modifier=".cg")
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # (a request without slots: all weights 0, output 0)
        w = tl.where(has_keys, tl.exp2(lse - m), 0.0)
        part = tl.load(mid_o_ptr + (offs_s * HQ + head)[:, None] * D + offs_d[None, :], mask=has_keys[:, None],
                       other=0.0, cache_modifier=".cg")
        denom = tl.sum(w, 0)
        out = tl.sum(part * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
        tl.store(attn_ptr + head * D + offs_d, out.to(attn_ptr.dtype.element_ty))


@triton.jit
def _attn_block_kernel(x_ptr, r_ptr, nw_ptr, wqkv_ptr, wo_ptr, summed_ptr, out_ptr, qw_ptr, kw_ptr, cos_ptr,
                       sin_ptr, pos_ptr, loc_ptr, k_buf_ptr, v_buf_ptr, kv_indptr_ptr, kv_indices_ptr, sync_ptr,
                       qkv_ptr, mid_o_ptr, mid_lse_ptr, attn_ptr, trace_ptr, eps, qk_eps, qk_scale, max_polls,
                       stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head, stride_cache, S,
                       H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                       BLOCK_ROW: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
                       QKV_BLOCK_R: tl.constexpr, QKV_BLOCK_K: tl.constexpr, O_BLOCK_R: tl.constexpr,
                       O_BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, QK_NORM: tl.constexpr,
                       DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
                       TRACE: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    _stamp(trace_ptr, pid, 0, TRACE)
    if PDL:
        gdc_wait()
    # phase 1: the norm (each program takes the whole row's scale) and the q/k/v rows
    act = summed_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_ROW)
    row_ok = cols < H
    summed = (tl.load(x_ptr + cols, mask=row_ok, other=0.0).to(tl.float32)
              + tl.load(r_ptr + cols, mask=row_ok, other=0.0).to(tl.float32)).to(act)
    sf = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / H + eps)
    if pid == 0:
        tl.store(summed_ptr + cols, summed, mask=row_ok)
    _gemv_rows(wqkv_ptr, qkv_ptr, qkv_ptr, x_ptr, r_ptr, nw_ptr, rstd, pid, P, (HQ + 2 * HKV) * D, H, True,
               QKV_BLOCK_R, QKV_BLOCK_K, NUM_STAGES)
    _stamp(trace_ptr, pid, 1, TRACE)
    _grid_barrier(sync_ptr, P, max_polls)
    _stamp(trace_ptr, pid, 2, TRACE)

    # phase 2: attention over the request's slots (kv_indptr [2]: one request)
    kv_start = tl.load(kv_indptr_ptr).to(tl.int64)
    seq_len = tl.load(kv_indptr_ptr + 1).to(tl.int64) - kv_start
    split_len = tl.cdiv(tl.cdiv(seq_len, S), BLOCK_N) * BLOCK_N
    cos, sin = rope_cos_sin(cos_ptr, sin_ptr, pos_ptr, 0, stride_cache, D // 2)
    slot = tl.load(loc_ptr).to(tl.int64)
    _attention_units(qkv_ptr, k_buf_ptr, v_buf_ptr, kv_start, seq_len, split_len, kv_indices_ptr, mid_o_ptr,
                     mid_lse_ptr, qw_ptr, kw_ptr, qk_eps, cos, sin, slot, qk_scale, pid, P, stride_kb_slot,
                     stride_kb_head, stride_vb_slot, stride_vb_head, S, HQ, HKV, D, BLOCK_H, BLOCK_N, QK_NORM,
                     DOT_DTYPE, DOT_PRECISION)
    _stamp(trace_ptr, pid, 3, TRACE)
    _grid_barrier(sync_ptr, 2 * P, max_polls)
    _stamp(trace_ptr, pid, 4, TRACE)

    # phase 3: the merge
    _merge_units(mid_o_ptr, mid_lse_ptr, attn_ptr, seq_len, split_len, pid, P, S, HQ, D, BLOCK_S)
    _stamp(trace_ptr, pid, 5, TRACE)
    _grid_barrier(sync_ptr, 3 * P, max_polls)
    _stamp(trace_ptr, pid, 6, TRACE)

    if PDL:  # every program is resident and past its last wait: the next kernel may start
        gdc_launch_dependents()
    # phase 4: the o rows
    _gemv_rows(wo_ptr, out_ptr, attn_ptr, x_ptr, r_ptr, nw_ptr, rstd, pid, P, H, HQ * D, False, O_BLOCK_R, O_BLOCK_K,
               NUM_STAGES)
    _stamp(trace_ptr, pid, 7, TRACE)
    _grid_exit(sync_ptr, P)


# ---- launcher -------------------------------------------------------------------------------------------

def _runs_on(device: torch.device) -> bool:
    """CUDA, or the CPU under the Triton interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def attn_block_supported(x: torch.Tensor, qkv_weight: torch.Tensor, o_weight: torch.Tensor, k_buffer: torch.Tensor,
                         num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether `attn_block_decode` runs this layer: one row on CUDA (or the CPU under the interpreter), contiguous
    weights in x's dtype (no bias, no FP8), a KV pool in x's dtype, a power-of-2 head_dim >= 16, rows of at most
    `MAX_ROW` features."""
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype not in ACT_DTYPES or not _runs_on(x.device):
        return False
    hidden, rows = x.shape[1], (num_heads + 2 * num_kv_heads) * head_dim
    return (hidden <= MAX_ROW and head_dim >= 16 and head_dim & (head_dim - 1) == 0 and num_kv_heads >= 1
            and num_heads % num_kv_heads == 0 and tuple(qkv_weight.shape) == (rows, hidden)
            and tuple(o_weight.shape) == (hidden, num_heads * head_dim) and k_buffer.dtype == x.dtype
            and k_buffer.dim() == 3 and tuple(k_buffer.shape[1:]) == (num_kv_heads, head_dim)
            and all(t.dtype == x.dtype and t.device == x.device and t.is_contiguous()
                    for t in (x, qkv_weight, o_weight)))


def _check_args(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
                o_weight: torch.Tensor, rope: BlockRope, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                kv_indptr: torch.Tensor, kv_indices: torch.Tensor, ws: AttnBlockWorkspace) -> tuple[int, int, int]:
    """`(Hq, Hkv, D)` of a block `attn_block_decode` runs; asserts with the reason otherwise."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.dtype in ACT_DTYPES, (
        f"x must be one {ACT_DTYPES} row [1, H], got {x.dtype} {tuple(x.shape)}")
    device, hidden = x.device, x.shape[1]
    assert k_buffer.dim() == 3 and v_buffer.shape == k_buffer.shape, (
        f"k/v buffers must be [slots, kv_heads, head_dim], got {tuple(k_buffer.shape)}, {tuple(v_buffer.shape)}")
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    num_heads = ws.attn.shape[0] // head_dim
    assert attn_block_supported(x, qkv_weight, o_weight, k_buffer, num_heads, num_kv_heads, head_dim), (
        f"the block does not run x {x.dtype} {tuple(x.shape)}, qkv {qkv_weight.dtype} {tuple(qkv_weight.shape)}, "
        f"o {o_weight.dtype} {tuple(o_weight.shape)}, pool {k_buffer.dtype} {tuple(k_buffer.shape)} on {device}")
    for name, t in (("residual", residual), ("norm_weight", norm_weight), ("v_buffer", v_buffer),
                    ("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("cos_cache", rope.cos_cache),
                    ("sin_cache", rope.sin_cache), ("positions", rope.positions), ("loc", rope.loc)):
        check_device(name, t, device)
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous(), (
        f"residual must be a contiguous {x.dtype} {tuple(x.shape)}, got {residual.dtype} {tuple(residual.shape)}")
    assert tuple(norm_weight.shape) == (hidden,) and norm_weight.is_contiguous(), (
        f"norm_weight must be a contiguous [{hidden}], got {tuple(norm_weight.shape)}")
    assert v_buffer.dtype == k_buffer.dtype and k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1, (
        "k/v buffers must share a dtype and have a contiguous last dim")
    for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("positions", rope.positions),
                    ("loc", rope.loc)):
        check_index(name, t)
    assert kv_indptr.shape[0] >= 2, f"kv_indptr needs [start, end] of the one request, got {tuple(kv_indptr.shape)}"
    assert (rope.q_norm is None) == (rope.k_norm is None), "give both q/k norm weights or neither"
    for name, w in (("q_norm", rope.q_norm), ("k_norm", rope.k_norm)):
        if w is not None:
            check_device(name, w, device)
            assert tuple(w.shape) == (head_dim,) and w.is_contiguous(), f"{name} must be a contiguous [{head_dim}]"
    for name, t in (("cos_cache", rope.cos_cache), ("sin_cache", rope.sin_cache)):
        assert t.dim() == 2 and t.shape[1] == head_dim // 2 and t.dtype == torch.float32 and t.is_contiguous(), (
            f"{name} must be a contiguous float32 [positions, {head_dim // 2}], got {t.dtype} {tuple(t.shape)}")
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    for name, t, shape, dtype in (("sync", ws.sync, (3,), torch.int32), ("qkv", ws.qkv, (rows,), x.dtype),
                                  ("mid_o", ws.mid_o, (ws.mid_o.shape[0], num_heads, head_dim), torch.float32),
                                  ("mid_lse", ws.mid_lse, (ws.mid_o.shape[0], num_heads), torch.float32),
                                  ("attn", ws.attn, (num_heads * head_dim,), x.dtype)):
        check_device(f"workspace.{name}", t, device)
        assert tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous(), (
            f"workspace.{name} must be a contiguous {dtype} {list(shape)}, got {t.dtype} {tuple(t.shape)}")
    return num_heads, num_kv_heads, head_dim


_PROGRAMS: dict[tuple[object, ...], int] = {}


def attn_block_decode(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      qkv_weight: torch.Tensor, o_weight: torch.Tensor, rope: BlockRope, k_buffer: torch.Tensor,
                      v_buffer: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float,
                      workspace: AttnBlockWorkspace, *, out: torch.Tensor | None = None,
                      config: AttnBlockConfig | None = None,
                      trace: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out, summed)` of one token's attention half, in one launch:

    `summed = x + residual` `[1, H]`; `h = rmsnorm(summed) * norm_weight` (rounded as `fused.rms_norm` rounds);
    `qkv = h @ qkv_weight.T` (q heads, then k, then v); q and the new k RMSNorm-ed per head (`rope.q_norm`,
    `rope.k_norm`) and rotated (neox halves) at `rope.positions[0]`; the new k and raw v stored at pool slot
    `rope.loc[0]`; attention of q over slots `kv_indices[kv_indptr[0]:kv_indptr[1]]` (the last of them
    `rope.loc[0]`) scaled by `sm_scale`; `out = attn @ o_weight.T` `[1, H]`.

    No host sync: a CUDA graph captures it. The grid spins on `workspace.sync`, so its programs must all be
    resident (nothing else may hold the SMs while it runs; a wait gives up after `SPIN_POLLS` polls and sets the
    workspace's error flag). The first call of a shape compiles the kernel and sizes its grid: make it before a
    capture. `trace` (CUDA, a benchmark's): int64 `[N, 16]`, a row per program, its global timer (ns, columns
    0..7) and SM cycle counter (8..15) at each of `TRACE_POINTS`."""
    num_heads, num_kv_heads, head_dim = _check_args(x, residual, norm_weight, qkv_weight, o_weight, rope, k_buffer,
                                                    v_buffer, kv_indptr, kv_indices, workspace)
    hidden = x.shape[1]
    cfg = config or AttnBlockConfig()
    ws = workspace
    splits = min(cfg.num_splits, ws.mid_o.shape[0])
    if out is None:
        out = torch.empty_like(x)
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous(), "out must be like x"
    summed = torch.empty_like(x)
    if trace is not None:
        from radixmesh.kernels.moe_block import globaltimer

        assert x.is_cuda and globaltimer is not None, "trace needs CUDA (the interpreter has no clocks)"
        assert trace.dtype == torch.int64 and trace.dim() == 2 and trace.shape[1] == 16 and trace.is_contiguous(), (
            f"trace must be a contiguous int64 [N, 16], got {trace.dtype} {tuple(trace.shape)}")
    operand = dot_dtype(x.dtype, x.device)
    no_norm = rope.cos_cache  # (a placeholder pointer: QK_NORM off never reads it)
    args = (x, residual, norm_weight, qkv_weight, o_weight, summed, out,
            rope.q_norm if rope.q_norm is not None else no_norm, rope.k_norm if rope.k_norm is not None else no_norm,
            rope.cos_cache, rope.sin_cache, rope.positions, rope.loc, k_buffer, v_buffer, kv_indptr, kv_indices,
            ws.sync, ws.qkv, ws.mid_o, ws.mid_lse, ws.attn, trace if trace is not None else ws.sync, eps, rope.eps,
            sm_scale * LOG2E, SPIN_POLLS if x.is_cuda else 1, k_buffer.stride(0), k_buffer.stride(1),
            v_buffer.stride(0), v_buffer.stride(1), rope.cos_cache.stride(0), splits)
    meta: dict[str, object] = {
        "H": hidden, "HQ": num_heads, "HKV": num_kv_heads, "D": head_dim, "BLOCK_ROW": next_power_of_2(hidden),
        "BLOCK_H": max(16, next_power_of_2(num_heads // num_kv_heads)), "BLOCK_S": next_power_of_2(splits),
        "BLOCK_N": cfg.block_n, "QKV_BLOCK_R": cfg.qkv_block_r, "QKV_BLOCK_K": cfg.qkv_block_k,
        "O_BLOCK_R": cfg.o_block_r, "O_BLOCK_K": cfg.o_block_k, "NUM_STAGES": cfg.num_stages,
        "QK_NORM": rope.q_norm is not None, "DOT_DTYPE": operand, "DOT_PRECISION": dot_precision(operand),
        "TRACE": trace is not None, "num_warps": cfg.num_warps,
        **pdl_args(x.device)}
    programs = 1
    if x.is_cuda:  # (the interpreter runs programs one after another: 1)
        key = (x.device, x.dtype, norm_weight.dtype, cfg, *sorted(meta.items(), key=lambda kv: kv[0]))
        found = _PROGRAMS.get(key)
        if found is None:
            compiled = _attn_block_kernel.warmup(*args, grid=(1,), **meta)
            found = _PROGRAMS[key] = resident_programs(compiled, x.device, cfg.ctas_per_sm)
        programs = found
    assert trace is None or trace.shape[0] >= programs, f"trace has {trace.shape[0]} rows for {programs} programs"
    _attn_block_kernel[(programs,)](*args, **meta)
    return out, summed
