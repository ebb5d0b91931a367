"""The grouped GEMMs of an MoE layer over the expert-aligned blocks of `moe_routing`, and the top-k combine.

One launch computes every expert's gate/up projection: a program takes one block of rows (one expert's
assignments, the tokens' activations gathered by `sorted_ids`) and `BLOCK_N` intermediate features, runs
the gate and up tiles of that expert side by side over K and stores `silu(gate) * up` at the rows' sorted
positions. One launch computes the down projection over those rows and stores each assignment's output at
its assignment index; `moe_combine` then sums each token's `top_k` outputs times their router weights.

Why a separate combine and not atomics in the down GEMM's epilogue: the sum is then in one fixed order
(the same tokens every run: greedy outputs and tests do not depend on thread timing), in float32 rather
than the output dtype, and needs no zeroed output first; its cost is one launch and `M * top_k * H` values
written and read once, under 1% of the expert weights a step reads up to M = 256 (measured by bench_moe).

Blocks of 16+ rows multiply on the tensor cores (`tl.dot`); blocks of 1..8 rows (decode) multiply and sum
in registers like the GEMV. FP8 experts (e4m3 weights, one float32 scale per output channel and expert)
run either with activations in their dtype (weights widened in registers: W8A16, fewer launches, for
memory-bound batches) or quantized per token (W8A8, FP8 tensor cores); the scales apply in the epilogue.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import (
    check_device,
    check_float,
    check_fp8,
    check_last_dim_contiguous,
    dot_dtype,
    dot_precision,
    next_power_of_2,
)
from radixmesh.kernels._jit import unspecialized
from radixmesh.kernels._pdl import gdc_launch_dependents, gdc_wait, pdl_args
from radixmesh.kernels._tiles import mma
from radixmesh.kernels.moe_config import MoeGemmConfig
from radixmesh.kernels.moe_routing import MoeAlignment


@triton.jit(**unspecialized(ints=("num_blocks",)))
def _moe_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr,
                     N, K, num_blocks, stride_a, stride_we, stride_wn, stride_se, stride_out,
                     TOP_K: tl.constexpr, GATED: tl.constexpr, GATHER_A: tl.constexpr, SCATTER_OUT: tl.constexpr,
                     A_FP8: tl.constexpr, W_FP8: tl.constexpr, USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     PRECISION: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    group_rows = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_rows
    pid_n = (pid % group) // group_rows
    if PDL:
        gdc_wait()
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # past the used blocks
        return
    offs_m = tl.arange(0, BLOCK_M)
    pos = pid_m * BLOCK_M + offs_m
    valid = offs_m < tl.load(block_rows_ptr + pid_m)
    # padding rows repeat the block's first row (no masks in the loop); their results are not stored
    pos_a = tl.where(valid, pos, pid_m * BLOCK_M)
    assign = tl.load(sorted_ptr + pos_a)
    if GATHER_A:  # the tokens' activations
        rows_a = assign // TOP_K
    else:  # the intermediate rows, in sorted order
        rows_a = pos_a
    if SCATTER_OUT:  # by assignment
        rows_out = assign
    else:  # by sorted position
        rows_out = pos
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_w = tl.where(offs_n < N, offs_n, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_a.to(tl.int64)[:, None] * stride_a + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + rows_w.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    up_ptrs = w_ptrs + N * stride_wn  # [BLOCK_K, BLOCK_N]: the expert's up rows follow its gate rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(k + offs_k)[None, :] < K, other=0.0)
            w = tl.load(w_ptrs, mask=(k + offs_k)[:, None] < K, other=0.0)
        acc = mma(a, w, acc, USE_DOT, A_FP8, DOT_DTYPE, PRECISION)
        if GATED:
            if EVEN_K:
                u = tl.load(up_ptrs)
            else:
                u = tl.load(up_ptrs, mask=(k + offs_k)[:, None] < K, other=0.0)
            acc_up = mma(a, u, acc_up, USE_DOT, A_FP8, DOT_DTYPE, PRECISION)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if PDL:
        gdc_launch_dependents()
    if A_FP8:
        a_scale = tl.load(a_scale_ptr + rows_a)[:, None]
        acc = acc * a_scale
        acc_up = acc_up * a_scale
    if W_FP8:
        s_ptr = w_scale_ptr + expert.to(tl.int64) * stride_se
        acc = acc * tl.load(s_ptr + rows_w)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(s_ptr + N + rows_w)[None, :]
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up
    out_ptrs = out_ptr + rows_out.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def _check_operands(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor | None,
                    al: MoeAlignment, a_rows: int, n_w: int) -> None:
    device = a.device
    for name, t in (("w", w), ("sorted_ids", al.sorted_ids), ("block_expert", al.block_expert)):
        check_device(name, t, device)
    assert a.dim() == 2 and a.shape[0] == a_rows, f"activations must be [{a_rows}, K], got {tuple(a.shape)}"
    assert w.dim() == 3 and w.shape[0] == al.num_local and w.shape[1] == n_w and w.shape[2] == a.shape[1], (
        f"weights must be [{al.num_local}, {n_w}, {a.shape[1]}] (local experts, rows, K), got {tuple(w.shape)}")
    check_last_dim_contiguous("activations", a)
    check_last_dim_contiguous("weights", w)
    if w_scale is None:
        check_float("weights", w)
        assert a_scale is None and a.dtype == w.dtype, f"activations are {a.dtype}, weights {w.dtype}"
        return
    check_fp8("weights", w)
    check_device("weight scales", w_scale, device)
    assert w_scale.dtype == torch.float32 and tuple(w_scale.shape) == (al.num_local, n_w) and w_scale.is_contiguous(), (
        f"weight scales must be a contiguous float32 [{al.num_local}, {n_w}], got {w_scale.dtype} "
        f"{tuple(w_scale.shape)}")
    if a_scale is None:
        check_float("activations", a)
        return
    assert a.dtype == w.dtype, f"FP8 activations are {a.dtype}, weights {w.dtype}"
    check_device("activation scales", a_scale, device)
    assert a_scale.dtype == torch.float32 and tuple(a_scale.shape) == (a_rows,) and a_scale.is_contiguous(), (
        f"activation scales must be a contiguous float32 [{a_rows}], got {a_scale.dtype} {tuple(a_scale.shape)}")


@functools.cache
def _smem_limit(device: torch.device) -> int:
    """Shared memory one program may use on a CUDA device (the opt-in limit)."""
    return int(torch.cuda.get_device_properties(device).shared_memory_per_block_optin)


def check_tiles_fit(cfg: MoeGemmConfig, block_m: int, a_dtype: torch.dtype, w_dtype: torch.dtype, gated: bool,
                    limit_bytes: int) -> None:
    """Fails, naming the tiles, when a tensor-core GEMM's pipelined loads exceed `limit_bytes` of shared memory
    (the compiler would refuse the kernel at its first launch)."""
    need = cfg.smem_bytes(block_m, a_dtype.itemsize, w_dtype.itemsize, gated)
    assert need <= limit_bytes, (
        f"{'gate/up' if gated else 'down'} tiles {cfg} at block_m {block_m} ({a_dtype} x {w_dtype}) need {need} "
        f"bytes of shared memory, the GPU has {limit_bytes}: use fewer num_stages or smaller tiles")


def _launch(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor | None,
            out: torch.Tensor, al: MoeAlignment, cfg: MoeGemmConfig, gated: bool) -> None:
    n, k = out.shape[1], a.shape[1]
    use_dot = al.block_m >= 16
    if use_dot and a.device.type == "cuda":
        check_tiles_fit(cfg, al.block_m, a.dtype, w.dtype, gated, _smem_limit(a.device))
    operand = dot_dtype(a.dtype if a_scale is None else torch.float32, a.device)  # unused by FP8 x FP8 dots
    grid = (al.num_blocks * triton.cdiv(n, cfg.block_n),)
    if grid[0] == 0:
        return
    _moe_gemm_kernel[grid](
        a, a_scale if a_scale is not None else a, w, w_scale if w_scale is not None else w, out, al.sorted_ids,
        al.block_expert, al.block_rows, n, k, al.num_blocks, a.stride(0), w.stride(0), w.stride(1),
        w_scale.stride(0) if w_scale is not None else 0, out.stride(0),
        TOP_K=al.top_k, GATED=gated, GATHER_A=gated, SCATTER_OUT=not gated, A_FP8=a_scale is not None,
        W_FP8=w_scale is not None, USE_DOT=use_dot, BLOCK_M=al.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, DOT_DTYPE=operand, PRECISION=dot_precision(operand),
        EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(a.device))


def _check_out(out: torch.Tensor, shape: tuple[int, int], a: torch.Tensor) -> None:
    check_device("out", out, a.device)
    check_float("out", out)
    assert tuple(out.shape) == shape and out.stride(-1) == 1, (
        f"out must be {list(shape)} with contiguous rows, got {tuple(out.shape)} strides {out.stride()}")


def moe_gate_up(x: torch.Tensor, al: MoeAlignment, w13: torch.Tensor, cfg: MoeGemmConfig, out: torch.Tensor, *,
                x_scale: torch.Tensor | None = None, w13_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(x @ gate_e.T) * (x @ up_e.T)` for every placed assignment, at its sorted position of `out`
    `[num_blocks * block_m, I]` (padding rows are left as they were).

    `x` `[M, H]` (float; or FP8 with `x_scale` `[M]`, per token), `w13` `[E_local, 2I, H]` (gate rows, then
    up rows; float like `x`, or FP8 with `w13_scale` `[E_local, 2I]`)."""
    inter = w13.shape[1] // 2
    _check_operands(x, x_scale, w13, w13_scale, al, al.topk_ids.shape[0], 2 * inter)
    _check_out(out, (al.num_blocks * al.block_m, inter), x)
    _launch(x, x_scale, w13, w13_scale, out, al, cfg, gated=True)
    return out


def moe_down(inter: torch.Tensor, al: MoeAlignment, w2: torch.Tensor, cfg: MoeGemmConfig, out: torch.Tensor, *,
             inter_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`inter_row @ down_e.T` for every placed assignment, at its assignment index `m * top_k + k` of `out`
    `[M * top_k, H]` (rows of assignments to other ranks' experts are left as they were).

    `inter` `[num_blocks * block_m, I]` from `moe_gate_up` (or FP8 with `inter_scale` per row), `w2`
    `[E_local, H, I]` (or FP8 with `w2_scale` `[E_local, H]`)."""
    _check_operands(inter, inter_scale, w2, w2_scale, al, al.num_blocks * al.block_m, w2.shape[1])
    _check_out(out, (al.topk_ids.numel(), w2.shape[1]), inter)
    _launch(inter, inter_scale, w2, w2_scale, out, al, cfg, gated=False)
    return out


@triton.jit
def _combine_kernel(y_ptr, ids_ptr, weights_ptr, out_ptr, H, stride_y, stride_out, expert_start, num_local,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    if PDL:
        gdc_wait()
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        local = tl.load(ids_ptr + m * TOP_K + k) - expert_start
        weight = tl.load(weights_ptr + m * TOP_K + k)
        width = tl.where((local >= 0) & (local < num_local), H, 0)  # other ranks' rows were never written
        y = tl.load(y_ptr + (m * TOP_K + k) * stride_y + offs, mask=offs < width, other=0.0)
        acc += weight * y.to(tl.float32)
    if PDL:
        gdc_launch_dependents()
    tl.store(out_ptr + m * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < H)


def moe_combine(y: torch.Tensor, al: MoeAlignment, out: torch.Tensor | None = None) -> torch.Tensor:
    """`out[m] = sum_k topk_weights[m, k] * y[m * top_k + k]` over this rank's experts, `[M, H]` in `y`'s
    dtype (or `out`'s), summed in float32 in slot order."""
    m, top_k = al.topk_ids.shape
    assert y.dim() == 2 and y.shape[0] == m * top_k, f"y must be [{m * top_k}, H], got {tuple(y.shape)}"
    check_float("y", y)
    check_last_dim_contiguous("y", y)
    check_device("topk_weights", al.topk_weights, y.device)
    hidden = y.shape[1]
    if out is None:
        out = torch.empty(m, hidden, dtype=y.dtype, device=y.device)
    _check_out(out, (m, hidden), y)
    if m == 0:
        return out
    block_h = min(1024, next_power_of_2(hidden))
    _combine_kernel[(m, triton.cdiv(hidden, block_h))](
        y, al.topk_ids, al.topk_weights, out, hidden, y.stride(0), out.stride(0), al.expert_start, al.num_local,
        TOP_K=top_k, BLOCK_H=block_h, num_warps=4, **pdl_args(y.device))
    return out
