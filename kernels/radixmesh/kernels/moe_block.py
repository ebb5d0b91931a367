"""A whole MoE block of one decode token in one persistent launch: the post-attention add + RMSNorm, the router,
its top-k, every chosen expert's gate/up and down GEMVs and their weighted sum.

    out, h, summed = moe_block_decode(x, residual, norm_w, eps, router_w, w13, w2, RouterSpec(8), workspace)

At batch 1 the block's four launches (`gemv_norm_out.gemv_add_rmsnorm_out`, then `moe_small`'s top-k, gate/up
and down) each wait for the one before it to end and ramp up again; the gaps, not the weight reads, are most of
the difference from the bandwidth floor. Here a grid of P programs, all resident at once (a few per SM), runs
three phases separated by grid barriers (a counter in the workspace, spun on in device memory):

1. norm and router: each program with router rows norms the row (redundantly: a few KB) and writes its rows'
   logits, rounded to the activations' dtype; program 0 writes `summed` and `h`.
2. top-k and gate/up: every program takes the top-k of the logits itself (`_topk_sorted`; program 0
   stores it and counts the expert load), then streams its share of the (slot, intermediate tile) units, each
   a `[2, BLOCK_I, BLOCK_K]` gate/up tile as `small_gate_up` loads it, into `silu(gate) * up` in `inter`.
3. down: its share of the hidden tiles, each all top-k experts' `[TK, BLOCK_H, BLOCK_K]` tiles as `small_down`
   computes one, writing the weighted sum (each expert's output rounded first, summed in float32) to `out`.

A program's units run as one flattened loop over (unit, K tile) with the unit's epilogue under an `if` at its
last tile, so the pipelined loads of the next unit do not wait for it. Data another program wrote in this launch
is read only after a barrier's acquire, with `.cg` loads where the load allows (L2, not the SM's own L1). The
grid must be co-resident or a barrier never fills: the launcher sizes P from the compiled kernel's registers and
shared memory; a wait gives up after `SPIN_POLLS` polls and sets the workspace's error flag instead of hanging the
GPU (`MoeBlockWorkspace.timed_out`). The next kernel may start (PDL) once every program is past the last barrier.
Under the interpreter (CPU) P = 1 and every barrier passes at once.

On an H200 it matches the four launches (Qwen3-30B-A3B: 27.03 against 26.78 us a layer; benchmarks, 2026-11-30
midday), so the model takes it only with RADIXMESH_MOE_PATH=block.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import check_device, next_power_of_2
from radixmesh.kernels._occupancy import resident_programs
from radixmesh.kernels._pdl import gdc_launch_dependents, gdc_wait, pdl_args
from radixmesh.kernels.gemv_norm_out import MAX_ROW, _normed_tile
from radixmesh.kernels.moe_config import MoeBlockConfig, block_default_config
from radixmesh.kernels.moe_routing import MAX_EXPERTS, RouterSpec
from radixmesh.kernels.moe_small import _scores, _store_topk

try:  # Triton's CUDA clocks (for `trace`; the interpreter has none)
    from triton.language.extra.cuda import globaltimer
except ImportError:  # pragma: no cover
    globaltimer = None

SPIN_POLLS = 1 << 22
"""Polls of a barrier's counter before a program gives up (sets the error flag and carries on): seconds, far
beyond any healthy wait."""
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""float32: the CPU model tests (under the interpreter); a GPU serves bf16 or fp16."""


@dataclass(frozen=True)
class MoeBlockWorkspace:
    """What `moe_block_decode`'s programs share, allocated once (a CUDA graph replays over it); one launch at a
    time uses it (the layers of one stream may share it)."""

    sync: torch.Tensor  # int32 [3]: barrier arrivals, exits (both back at 0 after every launch), error flag
    logits: torch.Tensor  # [1, E] in the activations' dtype
    topk_ids: torch.Tensor  # [1, top_k] int32
    topk_weights: torch.Tensor  # [1, top_k] float32
    inter: torch.Tensor  # [top_k, I]: silu(gate) * up of each slot's expert

    @classmethod
    def allocate(cls, num_experts: int, top_k: int, inter: int, hidden: int, dtype: torch.dtype,
                 device: torch.device) -> MoeBlockWorkspace:
        """Buffers for a block of `num_experts` experts (none holds a hidden row: `hidden` is only checked)."""
        assert 1 <= top_k <= num_experts and inter >= 1 and hidden >= 1, (
            f"bad block: {num_experts} experts, top_k {top_k}, inter {inter}, hidden {hidden}")
        return cls(torch.zeros(3, dtype=torch.int32, device=device),
                   torch.empty(1, num_experts, dtype=dtype, device=device),
                   torch.zeros(1, top_k, dtype=torch.int32, device=device),
                   torch.zeros(1, top_k, dtype=torch.float32, device=device),
                   torch.zeros(top_k, inter, dtype=dtype, device=device))

    def timed_out(self) -> bool:
        """Whether a barrier wait ever gave up (the grid was not co-resident; outputs since are garbage). Syncs."""
        return bool(self.sync[2].item())


# ---- the kernel -----------------------------------------------------------------------------------------

TRACE_POINTS = ("entry", "router", "barrier1", "topk", "gate_up", "barrier2", "down")
"""Where a traced launch stamps each program's clocks (`moe_block_decode(trace=...)`): on entry and after each step."""


@triton.jit
def _stamp(trace_ptr, pid, POINT: tl.constexpr, TRACE: tl.constexpr):
    """Program `pid`'s global timer (ns) and SM cycle counter at trace point POINT: `trace[pid, POINT]`,
    `trace[pid, 8 + POINT]`."""
    if TRACE:
        cycles = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(trace_ptr + pid * 16 + POINT, globaltimer())
        tl.store(trace_ptr + pid * 16 + 8 + POINT, cycles)


@triton.jit
def _grid_barrier(sync_ptr, target, max_polls):
    """Wait until `target` arrivals (P per barrier so far); every program's stores before it are then visible.

    A scalar atomic runs in one thread of the program (its result broadcast through shared memory), so each
    program arrives once; `debug_barrier` orders the other threads' stores before that release. (A flag the last
    arrival raises, polled apart from the counter, was slower on an H200: benchmarks, 2026-11-30 midday.)"""
    tl.debug_barrier()
    count = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu") + 1
    polls = 0
    while (count < target) & (polls < max_polls):
        count = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    if count < target:
        tl.store(sync_ptr + 2, 1)  # the error flag: not all programs were resident
    tl.debug_barrier()


@triton.jit
def _grid_exit(sync_ptr, P):
    """The last program out resets both counters (arrivals, exits) for the next launch: every program is past every
    wait by then."""
    if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == P - 1:
        tl.store(sync_ptr, 0)
        tl.store(sync_ptr + 1, 0)


@triton.jit
def _topk_sorted(x, cols, col_ok, scaling, TOP_K: tl.constexpr, BLOCK_TK: tl.constexpr, BLOCK_E: tl.constexpr,
                 SIGMOID: tl.constexpr, RENORM: tl.constexpr):
    """`moe_small._topk_of` (no bias) by one partial bitonic sort (`tl.topk`) instead of an argmax round per slot:
    each expert's key is its score's bits (scores are >= 0, so their bits order as they do) above its index
    reversed, so equal scores go to the lower expert, as argmax's ties do. The scores and weights are `_topk_of`'s.
    On an H200 the argmax rounds took ~4.3 us of a Qwen3-30B-A3B block's ~29 in every program, the sort 2.3
    (bench_moe_block --trace)."""
    scores = _scores(x, col_ok, SIGMOID)
    bits = tl.where(col_ok, scores.to(tl.int32, bitcast=True), -1).to(tl.int64)
    top = tl.topk((bits << 32) | (BLOCK_E - 1 - cols).to(tl.int64), BLOCK_TK)  # [BLOCK_TK], best first
    slot_ok = tl.arange(0, BLOCK_TK) < TOP_K
    ids = tl.where(slot_ok, BLOCK_E - 1 - (top & 0xFFFFFFFF), 0).to(tl.int32)
    weights = tl.where(slot_ok, (top >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
    if RENORM:
        weights = weights / tl.sum(weights, axis=0)
    return ids, weights * scaling


@triton.jit
def _router_rows(x_ptr, r_ptr, nw_ptr, rw_ptr, summed_ptr, h_ptr, logits_ptr, eps, pid, P,
                 H: tl.constexpr, E: tl.constexpr, BLOCK_ROW: tl.constexpr, PDL: tl.constexpr):
    """Phase 1: the logits of router rows pid, pid + P, ... (program 0 also writes `summed` and `h`)."""
    act = h_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_ROW)
    row_ok = cols < H
    # this program's first router row (a weight: loaded before the wait); none past the E-th program
    w = tl.load(rw_ptr + pid * H + cols, mask=cols < tl.where(pid < E, H, 0), other=0.0)
    if PDL:
        gdc_wait()
    if pid < E:
        summed = (tl.load(x_ptr + cols, mask=row_ok, other=0.0).to(tl.float32)
                  + tl.load(r_ptr + cols, mask=row_ok, other=0.0).to(tl.float32)).to(act)
        sf = summed.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / H + eps)
        normed = _normed_tile(x_ptr, r_ptr, nw_ptr, h_ptr, cols, H, rstd)  # [BLOCK_ROW] float32, rounded
        if pid == 0:
            tl.store(summed_ptr + cols, summed, mask=row_ok)
            tl.store(h_ptr + cols, normed.to(act), mask=row_ok)
        tl.store(logits_ptr + pid, tl.sum(w.to(tl.float32) * normed, axis=0).to(act))
        for e in range(pid + P, E, P):
            w = tl.load(rw_ptr + e * H + cols, mask=row_ok, other=0.0)
            tl.store(logits_ptr + e, tl.sum(w.to(tl.float32) * normed, axis=0).to(act))


@triton.jit
def _gate_up_units(h_ptr, w_ptr, inter_ptr, ids, pid, P, H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr,
                   BLOCK_TK: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Phase 2: `silu(gate) * up` of this program's units (slot, intermediate tile) into `inter` `[TOP_K, INTER]`."""
    I_TILES = (INTER + BLOCK_I - 1) // BLOCK_I
    K_TILES = (H + BLOCK_K - 1) // BLOCK_K
    units = TOP_K * I_TILES
    half = tl.arange(0, 2)
    offs_i = tl.arange(0, BLOCK_I)
    offs_k = tl.arange(0, BLOCK_K)
    kcol = tl.arange(0, BLOCK_TK)
    acc = tl.zeros((2, BLOCK_I, BLOCK_K), dtype=tl.float32)
    for t in tl.range(pid * units // P * K_TILES, (pid + 1) * units // P * K_TILES, num_stages=NUM_STAGES):
        unit = t // K_TILES
        k = (t - unit * K_TILES) * BLOCK_K
        slot = unit // I_TILES
        feats = (unit - slot * I_TILES) * BLOCK_I + offs_i
        expert = tl.sum(tl.where(kcol == slot, ids, 0), axis=0)
        # [2, BLOCK_I]: the gate rows, then the up rows INTER further (tail rows repeat the last; not stored)
        rows = half[:, None] * INTER + tl.where(feats < INTER, feats, INTER - 1)[None, :]
        w_ptrs = w_ptr + expert.to(tl.int64) * (2 * INTER * H) + rows.to(tl.int64)[:, :, None] * H + \
            (k + offs_k)[None, None, :]  # [2, BLOCK_I, BLOCK_K] of w13 [E, 2 * INTER, H]
        if H % BLOCK_K == 0:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            hk = tl.load(h_ptr + k + offs_k, cache_modifier=".cg")
        else:
            in_k = k + offs_k < H
            w = tl.load(w_ptrs, mask=in_k[None, None, :], other=0.0, eviction_policy="evict_first")
            hk = tl.load(h_ptr + k + offs_k, mask=in_k, other=0.0, cache_modifier=".cg")
        acc += w.to(tl.float32) * hk.to(tl.float32)[None, None, :]
        if k == (K_TILES - 1) * BLOCK_K:  # the unit's last tile: its epilogue
            gu = tl.sum(acc, axis=2)  # [2, BLOCK_I]
            gate = tl.sum(tl.where(half[:, None] == 0, gu, 0.0), axis=0)
            up = tl.sum(tl.where(half[:, None] == 1, gu, 0.0), axis=0)
            act = gate * tl.sigmoid(gate) * up
            tl.store(inter_ptr + slot * INTER + feats, act.to(inter_ptr.dtype.element_ty), mask=feats < INTER)
            acc = tl.zeros((2, BLOCK_I, BLOCK_K), dtype=tl.float32)


@triton.jit
def _down_units(inter_ptr, w_ptr, out_ptr, ids, weights, pid, P, H: tl.constexpr, INTER: tl.constexpr,
                TOP_K: tl.constexpr, BLOCK_TK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                NUM_STAGES: tl.constexpr):
    """Phase 3: `out` at this program's hidden tiles: the router-weighted sum of the top-k experts' outputs."""
    act = out_ptr.dtype.element_ty
    H_TILES = (H + BLOCK_H - 1) // BLOCK_H
    K_TILES = (INTER + BLOCK_K - 1) // BLOCK_K
    slot = tl.arange(0, BLOCK_TK)
    live = slot < TOP_K
    experts = tl.where(live, ids, 0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_TK, BLOCK_H, BLOCK_K), dtype=tl.float32)
    for t in tl.range(pid * H_TILES // P * K_TILES, (pid + 1) * H_TILES // P * K_TILES, num_stages=NUM_STAGES):
        tile = t // K_TILES
        k = (t - tile * K_TILES) * BLOCK_K
        offs_n = tile * BLOCK_H + offs_h
        rows = tl.where(offs_n < H, offs_n, H - 1).to(tl.int64)
        w_ptrs = w_ptr + experts[:, None, None] * (H * INTER) + rows[None, :, None] * INTER + \
            (k + offs_k)[None, None, :]  # [BLOCK_TK, BLOCK_H, BLOCK_K] of w2 [E, H, INTER]
        a_ptrs = inter_ptr + slot[:, None] * INTER + (k + offs_k)[None, :]  # [BLOCK_TK, BLOCK_K]
        mask = live[:, None]  # [BLOCK_TK, BLOCK_K]
        if INTER % BLOCK_K != 0:
            mask = mask & (k + offs_k < INTER)[None, :]
        w = tl.load(w_ptrs, mask=mask[:, None, :], other=0.0, eviction_policy="evict_first")
        a = tl.load(a_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        acc += w.to(tl.float32) * a.to(tl.float32)[:, None, :]
        if k == (K_TILES - 1) * BLOCK_K:
            y = tl.sum(acc, axis=2).to(act).to(tl.float32)  # [BLOCK_TK, BLOCK_H]: each expert's, rounded
            tl.store(out_ptr + offs_n, tl.sum(weights[:, None] * y, axis=0).to(act), mask=offs_n < H)
            acc = tl.zeros((BLOCK_TK, BLOCK_H, BLOCK_K), dtype=tl.float32)


@triton.jit
def _moe_block_kernel(x_ptr, r_ptr, nw_ptr, rw_ptr, w13_ptr, w2_ptr, summed_ptr, h_ptr, out_ptr, sync_ptr,
                      logits_ptr, ids_ptr, weights_ptr, inter_ptr, load_ptr, trace_ptr, eps, scaling, max_polls,
                      H: tl.constexpr, INTER: tl.constexpr,
                      E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_TK: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_ROW: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr,
                      COUNT_LOAD: tl.constexpr, BLOCK_I: tl.constexpr, UP_BLOCK_K: tl.constexpr,
                      UP_STAGES: tl.constexpr, BLOCK_H: tl.constexpr, DOWN_BLOCK_K: tl.constexpr,
                      DOWN_STAGES: tl.constexpr, PDL: tl.constexpr, TRACE: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    _stamp(trace_ptr, pid, 0, TRACE)
    _router_rows(x_ptr, r_ptr, nw_ptr, rw_ptr, summed_ptr, h_ptr, logits_ptr, eps, pid, P, H, E, BLOCK_ROW, PDL)
    _stamp(trace_ptr, pid, 1, TRACE)
    _grid_barrier(sync_ptr, P, max_polls)
    _stamp(trace_ptr, pid, 2, TRACE)

    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    logits = tl.load(logits_ptr + cols, mask=col_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    ids, weights = _topk_sorted(logits, cols, col_ok, scaling, TOP_K, BLOCK_TK, BLOCK_E, SIGMOID, RENORM)
    _stamp(trace_ptr, pid, 3, TRACE)
    if pid == 0:
        _store_topk(ids, weights, ids_ptr, weights_ptr, load_ptr, 0, TOP_K, BLOCK_TK, COUNT_LOAD)
    _gate_up_units(h_ptr, w13_ptr, inter_ptr, ids, pid, P, H, INTER, TOP_K, BLOCK_TK, BLOCK_I, UP_BLOCK_K, UP_STAGES)
    _stamp(trace_ptr, pid, 4, TRACE)
    _grid_barrier(sync_ptr, 2 * P, max_polls)
    _stamp(trace_ptr, pid, 5, TRACE)

    if PDL:  # every program is resident and past its last wait: the next kernel may start
        gdc_launch_dependents()
    _down_units(inter_ptr, w2_ptr, out_ptr, ids, weights, pid, P, H, INTER, TOP_K, BLOCK_TK, BLOCK_H, DOWN_BLOCK_K,
                DOWN_STAGES)
    _stamp(trace_ptr, pid, 6, TRACE)
    _grid_exit(sync_ptr, P)


# ---- launcher -------------------------------------------------------------------------------------------

def _runs_on(device: torch.device) -> bool:
    """CUDA, or the CPU under the Triton interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def moe_block_supported(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        spec: RouterSpec, *, w13_scale: torch.Tensor | None = None, expert_start: int = 0) -> bool:
    """Whether `moe_block_decode` runs this layer: one row, CUDA (or CPU under the interpreter), contiguous
    bf16/fp16/fp32 weights in x's dtype (no FP8 scales), all experts local (`expert_start == 0` and as many as
    router rows), at most `MAX_EXPERTS` experts, rows of at most `MAX_ROW` features, shapes consistent."""
    if w13_scale is not None or expert_start != 0 or x.dim() != 2 or x.shape[0] != 1 or x.dtype not in ACT_DTYPES:
        return False
    if not _runs_on(x.device) or router_weight.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        return False
    num_experts, hidden = router_weight.shape
    inter = w2.shape[2]
    return (hidden == x.shape[1] <= MAX_ROW and 1 <= spec.top_k <= num_experts <= MAX_EXPERTS and inter >= 1
            and tuple(w13.shape) == (num_experts, 2 * inter, hidden)
            and tuple(w2.shape) == (num_experts, hidden, inter)
            and all(t.dtype == x.dtype and t.device == x.device and t.is_contiguous()
                    for t in (x, router_weight, w13, w2)))


def _check_tensor(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> None:
    check_device(name, t, device)
    assert tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous(), (
        f"{name} must be a contiguous {dtype} {list(shape)}, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")


def _check_block(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, router_weight: torch.Tensor,
                 w13: torch.Tensor, w2: torch.Tensor, spec: RouterSpec) -> tuple[int, int, int]:
    """`(E, H, I)` of a block `moe_block_decode` runs; asserts with the reason otherwise."""
    assert x.dim() == 2 and x.shape[0] == 1, f"x must be one row [1, H], got {tuple(x.shape)}"
    assert x.dtype in ACT_DTYPES, f"x is {x.dtype}: the block runs {ACT_DTYPES}"
    hidden = x.shape[1]
    assert hidden <= MAX_ROW, f"rows of {hidden} features are wider than the {MAX_ROW} one program norms"
    assert router_weight.dim() == 2 and w2.dim() == 3, (
        f"router_weight must be [E, H] and w2 [E, H, I], got {tuple(router_weight.shape)}, {tuple(w2.shape)}")
    num_experts, inter = router_weight.shape[0], w2.shape[2]
    assert 1 <= num_experts <= MAX_EXPERTS, f"{num_experts} experts: the block handles 1..{MAX_EXPERTS}"
    assert spec.top_k <= num_experts, f"top_k {spec.top_k} exceeds the {num_experts} experts"
    for name, t, shape in (("x", x, (1, hidden)), ("residual", residual, (1, hidden)),
                           ("router_weight", router_weight, (num_experts, hidden)),
                           ("w13", w13, (num_experts, 2 * inter, hidden)), ("w2", w2, (num_experts, hidden, inter))):
        _check_tensor(name, t, shape, x.dtype, x.device)  # (the weights: all experts local, in x's dtype)
    check_device("norm_weight", norm_weight, x.device)
    assert tuple(norm_weight.shape) == (hidden,) and norm_weight.is_contiguous() and norm_weight.is_floating_point(), (
        f"norm_weight must be a contiguous float [{hidden}], got {norm_weight.dtype} {tuple(norm_weight.shape)}")
    return num_experts, hidden, inter


def _check_workspace(ws: MoeBlockWorkspace, num_experts: int, top_k: int, inter: int, x: torch.Tensor) -> None:
    for name, t, shape, dtype in (("sync", ws.sync, (3,), torch.int32),
                                  ("logits", ws.logits, (1, num_experts), x.dtype),
                                  ("topk_ids", ws.topk_ids, (1, top_k), torch.int32),
                                  ("topk_weights", ws.topk_weights, (1, top_k), torch.float32),
                                  ("inter", ws.inter, (top_k, inter), x.dtype)):
        _check_tensor(f"workspace.{name}", t, shape, dtype, x.device)


_PROGRAMS: dict[tuple[object, ...], int] = {}


def _num_programs(key: tuple[object, ...], device: torch.device, cfg: MoeBlockConfig, args: tuple[object, ...],
                  meta: dict[str, object]) -> int:
    """P: the device's SMs x the programs per SM asked for, lowered to what the compiled kernel lets an SM hold
    (once per kernel variant; the interpreter runs programs one after another: 1)."""
    if device.type == "cpu":
        return 1
    programs = _PROGRAMS.get(key)
    if programs is None:
        compiled = _moe_block_kernel.warmup(*args, grid=(1,), **meta)
        programs = _PROGRAMS[key] = resident_programs(compiled, device, cfg.ctas_per_sm)
    return programs


def moe_block_decode(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, spec: RouterSpec,
                     workspace: MoeBlockWorkspace, *, out: torch.Tensor | None = None,
                     expert_load: torch.Tensor | None = None, config: MoeBlockConfig | None = None,
                     trace: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(out, h, summed)` of one token's MoE block, in one launch:

    `summed = x + residual` and `h = rmsnorm(summed) * norm_weight` `[1, H]` as `gemv_add_rmsnorm_out` returns
    them; the router's logits `h @ router_weight.T` (into `workspace.logits`) and their top-k as `small_topk`
    takes it (into `workspace.topk_ids` / `topk_weights`; `expert_load` `[E]` int64 gets 1 per chosen expert);
    `out` `[1, H]` the experts' sum as `small_gate_up` + `small_down` compute it.

    `x`, `residual` `[1, H]` bf16/fp16/fp32; `router_weight` `[E, H]`, `w13` `[E, 2I, H]` (gate rows, then up rows),
    `w2` `[E, H, I]` in x's dtype (check `moe_block_supported` first). No host sync: a CUDA graph captures it.
    The grid spins on `workspace.sync`, so its programs must all be resident: nothing else may hold the SMs
    (another stream's kernel, MPS) while it runs, or a wait gives up after `SPIN_POLLS` polls, sets the
    workspace's error flag (`workspace.timed_out()`) and the outputs are garbage. The first call of a shape
    compiles the kernel and sizes its grid: make it before a capture.

    `trace` (CUDA, a benchmark's): int64 `[N, 16]` with a row for each program (N >= the grid); every program
    writes its global timer (ns, columns 0..6) and SM cycle counter (8..14) at each of `TRACE_POINTS`."""
    num_experts, hidden, inter = _check_block(x, residual, norm_weight, router_weight, w13, w2, spec)
    _check_workspace(workspace, num_experts, spec.top_k, inter, x)
    if expert_load is not None:
        _check_tensor("expert_load", expert_load, (num_experts,), torch.int64, x.device)
    if out is None:
        out = torch.empty_like(x)
    _check_tensor("out", out, (1, hidden), x.dtype, x.device)
    cfg = config or block_default_config(num_experts, inter, hidden, spec.top_k, x.device)
    h, summed = torch.empty_like(x), torch.empty_like(x)
    ws = workspace
    if trace is not None:
        assert x.is_cuda and globaltimer is not None, "trace needs CUDA (the interpreter has no clocks)"
        check_device("trace", trace, x.device)
        assert trace.dtype == torch.int64 and trace.dim() == 2 and trace.shape[1] == 16 and trace.is_contiguous(), (
            f"trace must be a contiguous int64 [N, 16], got {trace.dtype} {tuple(trace.shape)}")
    args = (x, residual, norm_weight, router_weight, w13, w2, summed, h, out, ws.sync, ws.logits, ws.topk_ids,
            ws.topk_weights, ws.inter, expert_load if expert_load is not None else ws.topk_ids,
            trace if trace is not None else ws.topk_ids, eps,
            spec.routed_scaling_factor, SPIN_POLLS if x.is_cuda else 1)  # (interpreted, no other program runs)
    meta: dict[str, object] = {
        "H": hidden, "INTER": inter, "E": num_experts, "TOP_K": spec.top_k, "BLOCK_TK": next_power_of_2(spec.top_k),
        "BLOCK_E": next_power_of_2(num_experts), "BLOCK_ROW": next_power_of_2(hidden),
        "SIGMOID": spec.scoring == "sigmoid", "RENORM": spec.renormalize, "COUNT_LOAD": expert_load is not None,
        "BLOCK_I": cfg.block_i, "UP_BLOCK_K": cfg.up_block_k, "UP_STAGES": cfg.up_stages, "BLOCK_H": cfg.block_h,
        "DOWN_BLOCK_K": cfg.down_block_k, "DOWN_STAGES": cfg.down_stages, "num_warps": cfg.num_warps,
        "TRACE": trace is not None, **pdl_args(x.device)}
    key = (x.device, x.dtype, norm_weight.dtype, cfg, *sorted(meta.items()))
    programs = _num_programs(key, x.device, cfg, args, meta)
    assert trace is None or trace.shape[0] >= programs, f"trace has {trace.shape[0]} rows for {programs} programs"
    _moe_block_kernel[(programs,)](*args, **meta)
    return out, h, summed
