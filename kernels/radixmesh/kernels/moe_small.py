"""The MoE layer for a few tokens (decode): top-k per token, a gate/up GEMV per assignment, a down GEMV per token.

    out = moe_small(x, router_logits, w13, w2, RouterSpec(top_k=8), topk_ids=ids, topk_weights=wts, inter=buf)

At a batch of a few tokens the sorted path (`moe_routing.route_align` + `moe_gemm`) spends more time placing
than multiplying: one routing program sorts 8 assignments into 128 experts' blocks, and the GEMMs' blocks are
mostly padding. Here nothing is sorted. Three launches, each a register GEMV like `gemv`:

1. `_topk_kernel`, one program per token: the router's scores, top-k and weights exactly as `route_align`
   computes them (ties to the lower expert), and the expert-load atomics.
2. `_gate_up_kernel`, a program per (assignment `m * top_k + k`, intermediate tile): reads its expert from
   `topk_ids`, streams that expert's gate and up rows as one `[2, BLOCK_N, BLOCK_K]` tile against the token,
   and stores `silu(gate) * up` in the activations' dtype at row `m * top_k + k` of `inter` `[M * top_k, I]`.
3. `_down_kernel`, a program per (token, hidden tile): loads all top-k experts' rows at once (a `[top_k,
   BLOCK_N, BLOCK_K]` tile: more loads in flight than one expert at a time), rounds each expert's output to
   the activations' dtype (as `moe_ref` does), and writes the router-weighted sum, taken in float32 in slot
   order, straight to the layer's output: no combine launch, no atomics, the same bits every run.

With `SmallMoeConfig.fuse_topk` the first launch goes: each gate/up program computes its token's top-k itself
(a row of E logits: cheap next to its weight tiles) and one program per token stores it for the down kernel.

Expert parallelism: assignments to experts outside `expert_start .. expert_start + num_local - 1` are skipped
by the gate/up programs and add 0 in the down sum. FP8 experts run W8A16 (e4m3 weights widened in registers,
one float32 scale per output channel applied to each row's sum). Every launch is sized from host ints, reads
and writes only buffers the caller passes (a `MoeWorkspace`'s), and takes PDL like the other decode kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import (
    check_device,
    check_float,
    check_fp8,
    check_last_dim_contiguous,
    next_power_of_2,
)
from radixmesh.kernels._pdl import gdc_launch_dependents, gdc_wait, pdl_args
from radixmesh.kernels.moe_config import SmallTiles
from radixmesh.kernels.moe_routing import MAX_EXPERTS, RouterSpec


@triton.jit
def _scores(x, col_ok, SIGMOID: tl.constexpr):
    """The router's scores of one row of float32 logits `x` `[BLOCK_E]` (`col_ok`: the experts that exist)."""
    if SIGMOID:
        return tl.sigmoid(x)
    x = tl.where(col_ok, x, float("-inf"))
    p = tl.exp(x - tl.max(x, axis=0))
    return p / tl.sum(p, axis=0)


@triton.jit
def _topk_of(x, bias, cols, col_ok, scaling, TOP_K: tl.constexpr, BLOCK_TK: tl.constexpr, SIGMOID: tl.constexpr,
             RENORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    """`(ids [BLOCK_TK] int32, weights [BLOCK_TK] float32)` of one row of float32 logits `x` `[BLOCK_E]`."""
    scores = _scores(x, col_ok, SIGMOID)
    select = scores
    if HAS_BIAS:
        select += bias
    select = tl.where(col_ok, select, float("-inf"))
    kcol = tl.arange(0, BLOCK_TK)
    ids = tl.zeros((BLOCK_TK,), dtype=tl.int32)
    weights = tl.zeros((BLOCK_TK,), dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.argmax(select, axis=0, tie_break_left=True).to(tl.int32)
        hit = cols == best
        ids = tl.where(kcol == i, best, ids)
        weights = tl.where(kcol == i, tl.sum(tl.where(hit, scores, 0.0), axis=0), weights)
        select = tl.where(hit, float("-inf"), select)
    if RENORM:
        weights = weights / tl.sum(weights, axis=0)
    return ids, weights * scaling


@triton.jit
def _store_topk(ids, weights, ids_ptr, weights_ptr, load_ptr, m, TOP_K: tl.constexpr, BLOCK_TK: tl.constexpr,
                COUNT_LOAD: tl.constexpr):
    kcol = tl.arange(0, BLOCK_TK)
    kmask = kcol < TOP_K
    tl.store(ids_ptr + m * TOP_K + kcol, ids, mask=kmask)
    tl.store(weights_ptr + m * TOP_K + kcol, weights, mask=kmask)
    if COUNT_LOAD:  # every chosen expert, local or not
        tl.atomic_add(load_ptr + ids, tl.full((BLOCK_TK,), 1, dtype=tl.int64), mask=kmask)


@triton.jit
def _topk_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, load_ptr, E, stride, scaling,
                 TOP_K: tl.constexpr, BLOCK_TK: tl.constexpr, BLOCK_E: tl.constexpr, SIGMOID: tl.constexpr,
                 RENORM: tl.constexpr, HAS_BIAS: tl.constexpr, COUNT_LOAD: tl.constexpr, PDL: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    bias = tl.zeros((BLOCK_E,), dtype=tl.float32)
    if HAS_BIAS:  # a weight of the model: loaded before the wait
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    x = tl.load(logits_ptr + m * stride + cols, mask=col_ok, other=0.0).to(tl.float32)
    if PDL:
        gdc_launch_dependents()
    ids, weights = _topk_of(x, bias, cols, col_ok, scaling, TOP_K, BLOCK_TK, SIGMOID, RENORM, HAS_BIAS)
    _store_topk(ids, weights, ids_ptr, weights_ptr, load_ptr, m, TOP_K, BLOCK_TK, COUNT_LOAD)


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, out_ptr, logits_ptr, bias_ptr, weights_ptr, load_ptr, N, K,
                    expert_start, num_local, stride_x, stride_we, stride_wn, stride_se, stride_out, E, stride_logits,
                    scaling, TOP_K: tl.constexpr, W_FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, ROUTE: tl.constexpr, BLOCK_TK: tl.constexpr,
                    BLOCK_E: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                    COUNT_LOAD: tl.constexpr, PDL: tl.constexpr):
    a = tl.program_id(0).to(tl.int64)  # the assignment m * TOP_K + k
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, 2)
    # [2, BLOCK_N]: the gate rows, then the up rows N further (tail rows repeat the last; their sums are not stored)
    rows = half[:, None] * N + tl.where(offs_n < N, offs_n, N - 1)[None, :]
    offs_k = tl.arange(0, BLOCK_K)
    if ROUTE:  # the token's top-k here (every program of the token: no launch of its own), one program stores it
        cols = tl.arange(0, BLOCK_E)
        col_ok = cols < E
        bias = tl.zeros((BLOCK_E,), dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        if PDL:
            gdc_wait()
        m = a // TOP_K
        logits = tl.load(logits_ptr + m * stride_logits + cols, mask=col_ok, other=0.0).to(tl.float32)
        ids, weights = _topk_of(logits, bias, cols, col_ok, scaling, TOP_K, BLOCK_TK, SIGMOID, RENORM, HAS_BIAS)
        if (pid_n == 0) & (a % TOP_K == 0):
            _store_topk(ids, weights, ids_ptr, weights_ptr, load_ptr, m, TOP_K, BLOCK_TK, COUNT_LOAD)
        local = tl.sum(tl.where(tl.arange(0, BLOCK_TK) == a % TOP_K, ids, 0), axis=0) - expert_start
    else:
        if PDL:
            gdc_wait()
        local = tl.load(ids_ptr + a) - expert_start
    if (local < 0) | (local >= num_local):  # another rank's expert
        return
    w_ptrs = w_ptr + local.to(tl.int64) * stride_we + rows.to(tl.int64)[:, :, None] * stride_wn + \
        offs_k[None, None, :]  # [2, BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + (a // TOP_K) * stride_x + offs_k
    acc = tl.zeros((2, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs + k, eviction_policy="evict_first")
            xk = tl.load(x_ptrs + k)
        else:
            w = tl.load(w_ptrs + k, mask=(k + offs_k)[None, None, :] < K, other=0.0, eviction_policy="evict_first")
            xk = tl.load(x_ptrs + k, mask=k + offs_k < K, other=0.0)
        acc += w.to(tl.float32) * xk.to(tl.float32)[None, None, :]
    if PDL:
        gdc_launch_dependents()
    h = tl.sum(acc, axis=2)  # [2, BLOCK_N]
    if W_FP8:
        h = h * tl.load(s_ptr + local.to(tl.int64) * stride_se + rows)
    gate = tl.sum(tl.where(half[:, None] == 0, h, 0.0), axis=0)
    up = tl.sum(tl.where(half[:, None] == 1, h, 0.0), axis=0)
    act = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + a * stride_out + offs_n, act.to(out_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _down_kernel(inter_ptr, ids_ptr, weights_ptr, w_ptr, s_ptr, out_ptr, N, K, expert_start, num_local, stride_i,
                 stride_we, stride_wn, stride_se, stride_out, TOP_K: tl.constexpr, BLOCK_TK: tl.constexpr,
                 W_FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                 EVEN_K: tl.constexpr, PDL: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(offs_n < N, offs_n, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    slot = tl.arange(0, BLOCK_TK)
    assign = m * TOP_K + slot
    if PDL:
        gdc_wait()
    local = tl.load(ids_ptr + assign, mask=slot < TOP_K, other=-1) - expert_start
    live = (slot < TOP_K) & (local >= 0) & (local < num_local)  # this rank's experts: the others add 0
    local = tl.where(live, local, 0).to(tl.int64)
    w_ptrs = w_ptr + local[:, None, None] * stride_we + rows.to(tl.int64)[None, :, None] * stride_wn + \
        offs_k[None, None, :]  # [BLOCK_TK, BLOCK_N, BLOCK_K]
    a_ptrs = inter_ptr + assign[:, None] * stride_i + offs_k[None, :]  # [BLOCK_TK, BLOCK_K]
    acc = tl.zeros((BLOCK_TK, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs + k, mask=live[:, None, None], other=0.0, eviction_policy="evict_first")
            ak = tl.load(a_ptrs + k, mask=live[:, None], other=0.0)
        else:
            in_k = k + offs_k < K
            w = tl.load(w_ptrs + k, mask=live[:, None, None] & in_k[None, None, :], other=0.0,
                        eviction_policy="evict_first")
            ak = tl.load(a_ptrs + k, mask=live[:, None] & in_k[None, :], other=0.0)
        acc += w.to(tl.float32) * ak.to(tl.float32)[:, None, :]
    weight = tl.load(weights_ptr + assign, mask=live, other=0.0)
    if PDL:
        gdc_launch_dependents()
    y = tl.sum(acc, axis=2)  # [BLOCK_TK, BLOCK_N]: each expert's output
    if W_FP8:
        y = y * tl.load(s_ptr + local[:, None] * stride_se + rows[None, :], mask=live[:, None], other=0.0)
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)  # stored in the activations' dtype, as moe_ref rounds
    out = tl.sum(weight[:, None] * y, axis=0)
    tl.store(out_ptr + m * stride_out + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)


# ---- launchers ------------------------------------------------------------------------------------------

def _check_topk_out(ids: torch.Tensor, weights: torch.Tensor, m: int, top_k: int, device: torch.device) -> None:
    check_device("topk_ids", ids, device)
    check_device("topk_weights", weights, device)
    assert ids.dtype == torch.int32 and tuple(ids.shape) == (m, top_k) and ids.is_contiguous(), (
        f"topk_ids must be a contiguous int32 [{m}, {top_k}], got {ids.dtype} {tuple(ids.shape)}")
    assert weights.dtype == torch.float32 and tuple(weights.shape) == (m, top_k) and weights.is_contiguous(), (
        f"topk_weights must be a contiguous float32 [{m}, {top_k}], got {weights.dtype} {tuple(weights.shape)}")


class RouteInputs(NamedTuple):
    """What `small_gate_up` needs to choose the experts itself (`SmallMoeConfig.fuse_topk`): the router's logits
    `[M, E]` and spec, where the weights go (`[M, top_k]` float32), and `small_topk`'s optional inputs."""

    logits: torch.Tensor
    spec: RouterSpec
    topk_weights: torch.Tensor
    correction_bias: torch.Tensor | None = None
    expert_load: torch.Tensor | None = None


def _check_route(r: RouteInputs, topk_ids: torch.Tensor) -> None:
    logits, spec = r.logits, r.spec
    assert logits.dim() == 2, f"logits must be [M, E], got {tuple(logits.shape)}"
    check_float("logits", logits)
    check_last_dim_contiguous("logits", logits)
    m, num_experts = logits.shape
    assert 1 <= num_experts <= MAX_EXPERTS, f"{num_experts} experts: the router handles 1..{MAX_EXPERTS}"
    assert spec.top_k <= num_experts, f"top_k {spec.top_k} exceeds the {num_experts} experts"
    _check_topk_out(topk_ids, r.topk_weights, m, spec.top_k, logits.device)
    if r.correction_bias is not None:
        check_device("correction_bias", r.correction_bias, logits.device)
        assert tuple(r.correction_bias.shape) == (num_experts,) and r.correction_bias.is_contiguous(), (
            f"correction_bias must be a contiguous [{num_experts}], got {tuple(r.correction_bias.shape)}")
    if r.expert_load is not None:
        check_device("expert_load", r.expert_load, logits.device)
        assert r.expert_load.dtype == torch.int64 and tuple(r.expert_load.shape) == (num_experts,) and \
            r.expert_load.is_contiguous(), f"expert_load must be a contiguous int64 [{num_experts}]"


class _RouteArgs(NamedTuple):
    """The router's arguments of `_topk_kernel` and of a routing `_gate_up_kernel` (placeholders without one)."""

    logits: torch.Tensor
    bias: torch.Tensor
    weights: torch.Tensor
    load: torch.Tensor
    num_experts: int
    stride: int
    scaling: float
    meta: dict[str, bool | int]  # the constexprs


def _route_args(r: RouteInputs | None, topk_ids: torch.Tensor) -> _RouteArgs:
    if r is None:
        return _RouteArgs(topk_ids, topk_ids, topk_ids, topk_ids, 1, 0, 1.0, {
            "ROUTE": False, "BLOCK_TK": 1, "BLOCK_E": 1, "SIGMOID": False, "RENORM": False, "HAS_BIAS": False,
            "COUNT_LOAD": False})
    bias, load = r.correction_bias, r.expert_load
    return _RouteArgs(
        r.logits, bias if bias is not None else r.logits, r.topk_weights, load if load is not None else topk_ids,
        r.logits.shape[1], r.logits.stride(0), r.spec.routed_scaling_factor, {
            "ROUTE": True, "BLOCK_TK": next_power_of_2(r.spec.top_k), "BLOCK_E": next_power_of_2(r.logits.shape[1]),
            "SIGMOID": r.spec.scoring == "sigmoid", "RENORM": r.spec.renormalize, "HAS_BIAS": bias is not None,
            "COUNT_LOAD": load is not None})


def small_topk(logits: torch.Tensor, spec: RouterSpec, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
               correction_bias: torch.Tensor | None = None, expert_load: torch.Tensor | None = None) -> None:
    """The router's choice for each row of `logits` `[M, E]` into `topk_ids` `[M, top_k]` (int32, global ids)
    and `topk_weights` (float32), as `route_align` chooses (see `moe_ref.route_ref`); `expert_load` `[E]`
    (int64) gets each chosen expert's assignments added."""
    route = RouteInputs(logits, spec, topk_weights, correction_bias, expert_load)
    _check_route(route, topk_ids)
    if logits.shape[0] == 0:
        return
    r = _route_args(route, topk_ids)
    meta = {k: v for k, v in r.meta.items() if k != "ROUTE"}
    _topk_kernel[(logits.shape[0],)](
        r.logits, r.bias, topk_ids, r.weights, r.load, r.num_experts, r.stride, r.scaling, TOP_K=spec.top_k, **meta,
        num_warps=1 if r.meta["BLOCK_E"] <= 256 else 4, **pdl_args(logits.device))


def _check_weights(name: str, w: torch.Tensor, scale: torch.Tensor | None, shape: tuple[int, int, int],
                   act: torch.Tensor) -> None:
    check_device(name, w, act.device)
    assert tuple(w.shape) == shape, f"{name} must be {list(shape)} (local experts, rows, K), got {tuple(w.shape)}"
    check_last_dim_contiguous(name, w)
    if scale is None:
        check_float(name, w)
        assert w.dtype == act.dtype, f"activations are {act.dtype}, {name} is {w.dtype}"
        return
    check_fp8(name, w)
    check_device(f"{name} scales", scale, act.device)
    assert scale.dtype == torch.float32 and tuple(scale.shape) == shape[:2] and scale.is_contiguous(), (
        f"{name} scales must be a contiguous float32 {list(shape[:2])}, got {scale.dtype} {tuple(scale.shape)}")


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, int], like: torch.Tensor) -> None:
    check_device(name, t, like.device)
    assert tuple(t.shape) == shape and t.dtype == like.dtype and t.stride(-1) == 1, (
        f"{name} must be a {like.dtype} {list(shape)} with contiguous rows, got {t.dtype} {tuple(t.shape)} "
        f"strides {t.stride()}")


def small_gate_up(x: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, tiles: SmallTiles, out: torch.Tensor,
                  *, w13_scale: torch.Tensor | None = None, expert_start: int = 0,
                  route: RouteInputs | None = None) -> torch.Tensor:
    """`silu(x[m] @ gate_e.T) * (x[m] @ up_e.T)` for every assignment (m, k) to a local expert e, at row
    `m * top_k + k` of `out` `[M * top_k, I]` (rows of other ranks' experts are left as they were).

    `x` `[M, H]`; `topk_ids` `[M, top_k]` int32 (global ids); `w13` `[E_local, 2I, H]` in `x`'s dtype, or FP8
    with `w13_scale` `[E_local, 2I]` (W8A16). With `route` the kernel chooses the experts itself (each program
    routes its token, as `small_topk` would) and stores them in `topk_ids` and `route.topk_weights`."""
    assert x.dim() == 2, f"x must be [M, H], got {tuple(x.shape)}"
    check_float("x", x)
    check_last_dim_contiguous("x", x)
    m, hidden = x.shape
    assert w13.dim() == 3 and w13.shape[1] % 2 == 0, f"w13 must be [E_local, 2I, H], got {tuple(w13.shape)}"
    num_local, inter = w13.shape[0], w13.shape[1] // 2
    _check_weights("w13", w13, w13_scale, (num_local, 2 * inter, hidden), x)
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == m and topk_ids.dtype == torch.int32 and \
        topk_ids.is_contiguous(), f"topk_ids must be a contiguous int32 [{m}, top_k], got {tuple(topk_ids.shape)}"
    check_device("topk_ids", topk_ids, x.device)
    top_k = topk_ids.shape[1]
    _check_rows("out", out, (m * top_k, inter), x)
    if route is not None:
        _check_route(route, topk_ids)
        assert route.logits.shape[0] == m, f"router logits for {route.logits.shape[0]} tokens, x holds {m}"
    if m == 0:
        return out
    r = _route_args(route, topk_ids)
    _gate_up_kernel[(m * top_k, triton.cdiv(inter, tiles.block_n))](
        x, topk_ids, w13, w13_scale if w13_scale is not None else w13, out, r.logits, r.bias, r.weights, r.load, inter,
        hidden, expert_start, num_local, x.stride(0), w13.stride(0), w13.stride(1),
        w13_scale.stride(0) if w13_scale is not None else 0, out.stride(0), r.num_experts, r.stride, r.scaling,
        TOP_K=top_k, W_FP8=w13_scale is not None, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        NUM_STAGES=tiles.num_stages, EVEN_K=hidden % tiles.block_k == 0, **r.meta, num_warps=tiles.num_warps,
        **pdl_args(x.device))
    return out


def small_down(inter: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w2: torch.Tensor,
               tiles: SmallTiles, out: torch.Tensor, *, w2_scale: torch.Tensor | None = None,
               expert_start: int = 0) -> torch.Tensor:
    """`out[m] = sum_k topk_weights[m, k] * (inter[m * top_k + k] @ down_e.T)` over this rank's experts e, summed
    in float32 in slot order, each expert's output rounded to `out`'s dtype first.

    `inter` `[M * top_k, I]` from `small_gate_up`; `w2` `[E_local, H, I]` in `inter`'s dtype, or FP8 with
    `w2_scale` `[E_local, H]`; `out` `[M, H]`."""
    assert topk_ids.dim() == 2, f"topk_ids must be [M, top_k], got {tuple(topk_ids.shape)}"
    m, top_k = topk_ids.shape
    _check_topk_out(topk_ids, topk_weights, m, top_k, inter.device)
    check_float("inter", inter)
    assert w2.dim() == 3, f"w2 must be [E_local, H, I], got {tuple(w2.shape)}"
    num_local, hidden, width = w2.shape
    _check_rows("inter", inter, (m * top_k, width), inter)
    _check_weights("w2", w2, w2_scale, (num_local, hidden, width), inter)
    _check_rows("out", out, (m, hidden), inter)
    if m == 0:
        return out
    _down_kernel[(m, triton.cdiv(hidden, tiles.block_n))](
        inter, topk_ids, topk_weights, w2, w2_scale if w2_scale is not None else w2, out, hidden, width, expert_start,
        num_local, inter.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0) if w2_scale is not None else 0,
        out.stride(0), TOP_K=top_k, BLOCK_TK=next_power_of_2(top_k), W_FP8=w2_scale is not None,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, NUM_STAGES=tiles.num_stages, EVEN_K=width % tiles.block_k == 0,
        num_warps=tiles.num_warps, **pdl_args(inter.device))
    return out
