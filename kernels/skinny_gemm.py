"""Decode-batch linear layers `y = x @ W.T` for a few rows (a decode step at batch 2-256): `x` `[M, K]`, `W` `[N, K]`.

At these batch sizes a linear layer is still mostly a read of its weights (M x K activations against N x K
weights), so the kernel is laid out for bandwidth: each program owns `BLOCK_N` output features and all of the rows
when `BLOCK_M` covers M (the weights cross the memory bus once), or the programs of one weight tile run next to each
other when it does not (the second row block finds the tile in L2). Tensor cores do the products (tl.dot), in float32.

Not used by the engine: an experiment asking whether cuBLAS leaves decode-batch bandwidth unused. On an H100
(`python -m radixmesh.kernels.bench_skinny_gemm --sweep`, 8B shapes, docs/benchmarks/h100-skinny-gemm-2026-11-27.jsonl)
the best tiles of a sweep match cuBLAS at 32-64 rows (gate_up 2.72 vs 2.60-2.64 TB/s, qkv 2.26-2.28 vs 2.18-2.27)
and lose from 128 rows on (qkv at 168 rows 1.58 vs 2.08 TB/s, o 1.44 vs 1.91): the offline benchmark's decode
batches run at 100-170 rows, where the products are no longer cheap next to the reads.
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


@dataclass(frozen=True)
class SkinnyConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_n = pid // num_m  # the row blocks of one weight tile are neighbours: the tile is read from memory once
    pid_m = pid % num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    mask_m = offs_m[:, None] < M
    mask_n = offs_n[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        cols = k + offs_k
        if EVEN_K:
            x = tl.load(x_rows + cols[None, :], mask=mask_m, other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=mask_n, other=0.0, eviction_policy="evict_first")
        else:
            in_k = cols[None, :] < K
            x = tl.load(x_rows + cols[None, :], mask=mask_m & in_k, other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=mask_n & in_k, other=0.0, eviction_policy="evict_first")
        acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision=DOT_PRECISION)
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_y + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m & (offs_n[None, :] < N))


SHARED_BYTES = 200 << 10
"""Shared memory the pipelined tiles may take (an H100 has 227 KB a block; `stages x (BLOCK_M + BLOCK_N) x BLOCK_K`
elements of 2 bytes)."""
MAX_ROWS = 256
"""Above this many rows the GEMM libraries' compute-bound kernels are the right tool."""


def default_config(m: int, n: int, k: int) -> SkinnyConfig:
    """All rows in one block up to 128 (the weights cross the bus once), two blocks above; 64 output features a
    program where that still gives an H100's 132 SMs work, K in tiles of 128."""
    block_m = max(16, min(128, next_power_of_2(m)))
    block_n = 128 if n // 128 * triton.cdiv(m, block_m) >= 264 else 64
    stages = max(2, min(4, SHARED_BYTES // ((block_m + block_n) * 128 * 2)))
    return SkinnyConfig(block_m, block_n, 128, 4 if block_m * block_n <= 8192 else 8, stages)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                config: SkinnyConfig | None = None) -> torch.Tensor:
    """`x @ weight.T` for `x` `[M, K]` (M <= MAX_ROWS) and `weight` `[N, K]`, both fp16/bf16 of one dtype; `[M, N]`."""
    assert x.dim() == 2, f"x must be [M, K], got {tuple(x.shape)}"
    assert weight.dim() == 2, f"weight must be [N, K], got {tuple(weight.shape)}"
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k, f"x has {k} features, weight expects {weight.shape[1]}"
    assert m <= MAX_ROWS, f"x has {m} rows; skinny_gemm takes at most {MAX_ROWS}"
    check_device("weight", weight, x.device)
    check_float("x", x)
    assert x.dtype in (torch.float16, torch.bfloat16), f"x is {x.dtype}: skinny_gemm takes fp16 or bf16"
    assert weight.dtype == x.dtype, f"x is {x.dtype}, weight is {weight.dtype}"
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert tuple(out.shape) == (m, n) and out.dtype == x.dtype and out.stride(-1) == 1, (
        f"out must be a {x.dtype} tensor of shape {(m, n)} with a contiguous last dim")
    check_device("out", out, x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or default_config(m, n, k)
    operand = dot_dtype(x.dtype, x.device)
    grid = (triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m),)
    _skinny_gemm_kernel[grid](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
        EVEN_K=k % cfg.block_k == 0, DOT_DTYPE=operand, DOT_PRECISION=dot_precision(operand), num_warps=cfg.num_warps,
    )
    return out
