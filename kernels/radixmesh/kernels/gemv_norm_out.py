"""A batch-1 GEMV whose input is the add + RMSNorm before it, and which also writes that normed row out: the
router of an MoE block (`[E, hidden]`, e.g. 128 x 2048) with the block's post-attention norm, in one launch.

The experts read the normed row, so unlike `gemv_fused.gemv_add_rmsnorm` (which scales the dot products by the
norm at the end and never rounds the normed row) the row is normed first, rounded as `fused.rms_norm` rounds it
(the sum, the normed row, its product with the weight), and the projection runs over that rounded row: the
logits are the ones `gemv` computes from `rms_norm`'s output with the same tiles, so the routing is the unfused
path's. The norm's scale is a reduction over the whole row; each program takes it from one tile of the whole row
(a hidden size of a few thousand) after loading its first weight tile, then streams its weight rows. Every
program writes its own slice of the normed row and of the new residual (`x + residual`).

Saves the RMSNorm's launch before the router (~2 us of a Qwen3-30B-A3B batch-1 step's 48 layers each).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import check_device, check_float, next_power_of_2
from radixmesh.kernels._pdl import gdc_launch_dependents, gdc_wait, pdl_args
from radixmesh.kernels.gemv import GemvConfig, fused_config
from radixmesh.kernels.gemv_fused import _check_row, _check_weight

MAX_ROW = 16384
"""Widest row whose norm one program takes from one tile."""


@triton.jit
def _normed_tile(x_ptr, r_ptr, nw_ptr, y_ptr, cols, K, rstd):
    """The normed row's values at `cols` in float32, rounded as `fused.rms_norm` rounds them (to y's dtype)."""
    act = y_ptr.dtype.element_ty
    mask = cols < K
    s = (tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
         + tl.load(r_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(act).to(tl.float32)
    nw = tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (nw * (s * rstd).to(act).to(tl.float32)).to(act).to(tl.float32)


@triton.jit
def _gemv_norm_out_kernel(x_ptr, r_ptr, nw_ptr, r_out_ptr, h_ptr, w_ptr, y_ptr, N, K, stride_w, eps, slice_len,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_ROW: tl.constexpr,
                          NUM_STAGES: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    act = y_ptr.dtype.element_ty
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    # the first weight tile is loaded before waiting for the kernel that writes x (radixmesh.kernels._pdl)
    w = tl.load(rows + offs_k[None, :], mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0,
                eviction_policy="evict_first")
    if PDL:
        gdc_wait()
    # the whole row's scale, as `fused.rms_norm` takes it: [BLOCK_ROW]
    offs_row = tl.arange(0, BLOCK_ROW)
    row_mask = offs_row < K
    summed = (tl.load(x_ptr + offs_row, mask=row_mask, other=0.0).to(tl.float32)
              + tl.load(r_ptr + offs_row, mask=row_mask, other=0.0).to(tl.float32)).to(act)
    sf = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / K + eps)
    own = row_mask & (offs_row >= pid * slice_len) & (offs_row < (pid + 1) * slice_len)  # this program's slice
    tl.store(r_out_ptr + offs_row, summed, mask=own)
    nw = tl.load(nw_ptr + offs_row, mask=own, other=0.0).to(tl.float32)
    tl.store(h_ptr + offs_row, (nw * (sf * rstd).to(act).to(tl.float32)).to(act), mask=own)
    acc = w.to(tl.float32) * _normed_tile(x_ptr, r_ptr, nw_ptr, y_ptr, offs_k, K, rstd)[None, :]
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=NUM_STAGES):
        cols = k + offs_k
        if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no mask on the weight tiles
            w = tl.load(rows + cols[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(rows + cols[None, :], mask=(offs_n[:, None] < N) & (cols[None, :] < K), other=0.0,
                        eviction_policy="evict_first")
        acc += w.to(tl.float32) * _normed_tile(x_ptr, r_ptr, nw_ptr, y_ptr, cols, K, rstd)[None, :]
    if PDL:
        gdc_launch_dependents()
    tl.store(y_ptr + offs_n, tl.sum(acc, axis=1).to(act), mask=offs_n < N)


def gemv_add_rmsnorm_out(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         weight: torch.Tensor, config: GemvConfig | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(y, h, x + residual)` for `x`, `residual` `[1, K]` (bf16/fp16/fp32) and `weight` `[N, K]` in x's dtype:
    `h = rmsnorm(x + residual) * norm_weight` `[1, K]` (as `fused.rms_norm` returns it) and `y = h @ weight.T`
    `[1, N]` (as `gemv` returns it with the same tiles)."""
    check_float("x", x)
    k = x.shape[-1]
    device = x.device
    _check_row("x", x, k, x.dtype, device)
    _check_row("residual", residual, k, x.dtype, device)
    check_device("norm_weight", norm_weight, device)
    check_float("norm_weight", norm_weight)
    assert tuple(norm_weight.shape) == (k,) and norm_weight.is_contiguous(), (
        f"norm_weight must be a contiguous [{k}], got {tuple(norm_weight.shape)}")
    assert k <= MAX_ROW, f"rows of {k} features are wider than the {MAX_ROW} one program norms"
    n = _check_weight(weight, None, k, device)
    assert n > 0, "weight has no rows"
    assert weight.dtype == x.dtype, f"weight is {weight.dtype}, the input is {x.dtype}"
    cfg = config or fused_config("router", n, k, fp8=False)
    out = torch.empty((1, n), dtype=x.dtype, device=device)
    normed, summed = torch.empty_like(x), torch.empty_like(x)
    grid = triton.cdiv(n, cfg.block_n)
    _gemv_norm_out_kernel[(grid,)](
        x, residual, norm_weight, summed, normed, weight, out, n, k, weight.stride(0), eps, triton.cdiv(k, grid),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_ROW=next_power_of_2(k), NUM_STAGES=cfg.num_stages,
        EVEN=n % cfg.block_n == 0 and k % cfg.block_k == 0, num_warps=cfg.num_warps, **pdl_args(device))
    return out, normed, summed
