"""Batch-1 GEMVs that compute their own input: the elementwise step before a projection runs in the
GEMV's loop instead of as a launch of its own.

A batch-1 decode step is ~10 launches per layer; two RMSNorms (with the residual add) and the
SiLU-and-mul are tiny launches whose fixed cost (~2-3 us each on an H100, with their gaps) adds up to
~0.2 ms of an 8B step. Here:

- `gemv_add_rmsnorm`: `y = W @ (rmsnorm(x + residual) * norm_weight)`, and `x + residual` (the new
  residual stream) is written out (by program 0). The norm's scale is a reduction over the whole row:
  every program sums the squares along its own K loop and scales its dot products at the end, so
  the normalized row is never rounded to the activation dtype (the unfused path rounds it twice).
- with `gated=True` (an MLP's stacked gate/up projection), each program also takes the up rows that
  match its gate rows and returns `silu(gate) * up`, rounded as `radixmesh.kernels.fused.silu_and_mul`
  rounds: SiLU-and-mul costs a few instructions per output instead of a launch. (SiLU-and-mul computed
  per input element inside the down projection's loop instead measured slower than its own launch.)

The projection is `gemv`'s loop (bf16/fp16/fp32 weights, or FP8 with one scale per row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import check_device, check_float, check_fp8, check_last_dim_contiguous
from radixmesh.kernels._pdl import gdc_launch_dependents, gdc_wait, pdl_args
from radixmesh.kernels.gemv import GemvConfig, fused_config, load_x_tile
from radixmesh.kernels.lora_gemv import LoraEpilogue, epilogue_args, lora_epilogue


@triton.jit
def _norm_tile(x_ptr, r_ptr, nw_ptr, r_out_ptr, cols, K, store_limit, EARLY: tl.constexpr = False):
    """(squares, h) of one K tile: `s = x + r` rounded to the activation dtype (written out where
    `cols < store_limit`), its squares and `s * nw`, in float32. `EARLY`: x and r are read before the kernel's PDL
    wait (after a LoRA shrink, radixmesh.kernels.lora_gemv), from L2 past the SM's L1."""
    mask_k = cols < K
    x, r = load_x_tile(x_ptr, cols, K, False, EARLY), load_x_tile(r_ptr, cols, K, False, EARLY)
    summed = (x.to(tl.float32) + r.to(tl.float32)).to(r_out_ptr.dtype.element_ty)
    tl.store(r_out_ptr + cols, summed, mask=cols < store_limit)
    part = summed.to(tl.float32)
    return part * part, part * tl.load(nw_ptr + cols, mask=mask_k, other=0.0).to(tl.float32)


@triton.jit
def _project(acc, rstd, s_ptr, add_ptr, offs_n, N, HAS_SCALE: tl.constexpr, HAS_ADDEND: tl.constexpr):
    """The rows' dot products (`acc` `[BLOCK_N, BLOCK_K]` partial sums) normed, scaled (FP8 weights: one scale
    per row) and plus the addend (a float32 term per row, a LoRA adapter's), in float32."""
    y = tl.sum(acc, axis=1) * rstd
    if HAS_SCALE:
        y = y * tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)
    if HAS_ADDEND:
        y += tl.load(add_ptr + offs_n, mask=offs_n < N, other=0.0)
    return y


@triton.jit
def _gemv_norm_kernel(x_ptr, r_ptr, nw_ptr, r_out_ptr, w_ptr, s_ptr, add_ptr, y_ptr, N, K, stride_w, eps,
                      xa_ptr, lb_ptr, lslots_ptr, lranks_ptr, lscalings_ptr, ln0, ln1, lsplits, lstride_split,
                      lstride_bs, lstride_bn,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN: tl.constexpr,
                      HAS_SCALE: tl.constexpr, HAS_ADDEND: tl.constexpr, GATED: tl.constexpr, HAS_LORA: tl.constexpr,
                      R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    # y = rstd * sum_k W[n, k] * (s[k] * nw[k]) with s = x + r: the norm's scale, a whole-row reduction, is
    # summed along the same loop and applied to the dot products at the end, so the weights stream from the
    # first instruction (a reduction before the loop held every program's first loads back).
    # GATED: W is [gate; up] (2N rows); the program takes gate rows n and up rows N + n, y = silu(gate) * up
    pid = tl.program_id(0)
    act = y_ptr.dtype.element_ty
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    up_rows = rows + N.to(tl.int64) * stride_w
    store_limit = tl.where(pid == 0, K, 0)  # program 0 writes the new residual
    # the first weight tiles are loaded before waiting for the kernel that writes x (radixmesh.kernels._pdl)
    first_mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    w = tl.load(rows + offs_k[None, :], mask=first_mask, other=0.0, eviction_policy="evict_first")
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if GATED:
        w_up = tl.load(up_rows + offs_k[None, :], mask=first_mask, other=0.0, eviction_policy="evict_first")
    if PDL and not HAS_LORA:  # with an adapter: before the epilogue (see radixmesh.kernels.gemv)
        gdc_wait()
    squares, h = _norm_tile(x_ptr, r_ptr, nw_ptr, r_out_ptr, offs_k, K, store_limit, HAS_LORA)
    acc = w.to(tl.float32) * h[None, :]
    if GATED:
        acc_up = w_up.to(tl.float32) * h[None, :]
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=NUM_STAGES):
        cols = k + offs_k
        if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no mask on the weight tiles
            w = tl.load(rows + cols[None, :], eviction_policy="evict_first")
            if GATED:
                w_up = tl.load(up_rows + cols[None, :], eviction_policy="evict_first")
        else:
            mask = (offs_n[:, None] < N) & (cols[None, :] < K)
            w = tl.load(rows + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
            if GATED:
                w_up = tl.load(up_rows + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
        sq, h = _norm_tile(x_ptr, r_ptr, nw_ptr, r_out_ptr, cols, K, store_limit, HAS_LORA)
        squares += sq
        acc += w.to(tl.float32) * h[None, :]
        if GATED:
            acc_up += w_up.to(tl.float32) * h[None, :]
    if PDL:
        gdc_launch_dependents()
        if HAS_LORA:
            gdc_wait()
    rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
    y = _project(acc, rstd, s_ptr, add_ptr, offs_n, N, HAS_SCALE, HAS_ADDEND)
    if HAS_LORA:  # the row's adapter on the normed input (radixmesh.kernels.lora_gemv): its sums scaled by rstd
        y += rstd * lora_epilogue(xa_ptr, lb_ptr, lslots_ptr, lranks_ptr, lscalings_ptr, offs_n, offs_n < N, ln0,
                                  ln1, lsplits, lstride_split, lstride_bs, lstride_bn, R, BLOCK_R, BLOCK_S)
    if GATED:  # rounded as the unfused path rounds: the projection, SiLU's output, the product
        up = _project(acc_up, rstd, s_ptr + N, add_ptr + N, offs_n, N, HAS_SCALE, HAS_ADDEND)
        if HAS_LORA:  # up rows are rows N.. of the stacked weight (B's second slice)
            up += rstd * lora_epilogue(xa_ptr, lb_ptr, lslots_ptr, lranks_ptr, lscalings_ptr, offs_n + N, offs_n < N,
                                       ln0, ln1, lsplits, lstride_split, lstride_bs, lstride_bn, R, BLOCK_R, BLOCK_S)
        gate = y.to(act).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate))).to(act).to(tl.float32) * up.to(act).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(act), mask=offs_n < N)


def _check_weight(weight: torch.Tensor, weight_scale: torch.Tensor | None, k: int, device: torch.device) -> int:
    assert weight.dim() == 2, f"weight must be [N, K], got {tuple(weight.shape)}"
    n = weight.shape[0]
    assert weight.shape[1] == k, f"the input has {k} features, weight expects {weight.shape[1]}"
    check_device("weight", weight, device)
    check_last_dim_contiguous("weight", weight)
    if weight_scale is None:
        check_float("weight", weight)
    else:
        check_fp8("weight", weight)
        check_device("weight_scale", weight_scale, device)
        assert weight_scale.dtype == torch.float32 and tuple(weight_scale.shape) == (n,) and \
            weight_scale.is_contiguous(), f"weight_scale must be a contiguous float32 [{n}]"
    return n


def check_addend(addend: torch.Tensor | None, n: int, device: torch.device) -> None:
    """An addend is a contiguous float32 `[1, n]` (one term per weight row) on the device, or None."""
    if addend is None:
        return
    check_device("addend", addend, device)
    assert addend.dtype == torch.float32 and tuple(addend.shape) == (1, n) and addend.is_contiguous(), (
        f"addend must be a contiguous float32 [1, {n}], got {addend.dtype} {tuple(addend.shape)}")


def _check_row(name: str, t: torch.Tensor, width: int, dtype: torch.dtype, device: torch.device) -> None:
    check_device(name, t, device)
    assert tuple(t.shape) == (1, width), f"{name} must be [1, {width}], got {tuple(t.shape)}"
    assert t.dtype == dtype, f"{name} is {t.dtype}, expected {dtype}"
    assert t.is_contiguous(), f"{name} must be contiguous"


def _plan(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, k: int, n_out: int,
          config: GemvConfig | None, kind: str) -> tuple[torch.Tensor, GemvConfig, bool]:
    """(the output `[1, n_out]`, the tile configuration, whether the tiles cover the rows and K evenly)."""
    n = weight.shape[0]
    if weight_scale is None:
        assert weight.dtype == x.dtype, f"weight is {weight.dtype}, the input is {x.dtype}"
    cfg = config or fused_config(kind, n, k, weight_scale is not None)
    out = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    return out, cfg, n_out % cfg.block_n == 0 and k % cfg.block_k == 0


def gemv_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, weight_scale: torch.Tensor | None = None, gated: bool = False,
                     config: GemvConfig | None = None, addend: torch.Tensor | None = None,
                     lora: LoraEpilogue | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(y, x + residual)` for `x`, `residual` `[1, K]` (bf16/fp16/fp32) and `weight` `[N, K]` in x's dtype,
    or FP8 with `weight_scale` `[N]` float32: `y = h @ weight.T` with `h = rmsnorm(x + residual) * norm_weight`,
    `[1, N]`; `gated`: `weight` is `[gate; up]` and `y = silu(h @ gate.T) * (h @ up.T)`, `[1, N / 2]`.
    `addend` (float32 `[1, N]`, e.g. a LoRA adapter's output) is added to the projection before rounding and
    the SiLU, as is the adapter of `lora` (`lora_gemv_shrink` of the same x, residual and norm_weight)."""
    check_float("x", x)
    k = x.shape[-1]
    _check_row("x", x, k, x.dtype, x.device)
    _check_row("residual", residual, k, x.dtype, x.device)
    check_device("norm_weight", norm_weight, x.device)
    check_float("norm_weight", norm_weight)
    assert tuple(norm_weight.shape) == (k,) and norm_weight.is_contiguous(), (
        f"norm_weight must be a contiguous [{k}], got {tuple(norm_weight.shape)}")
    n = _check_weight(weight, weight_scale, k, x.device)
    check_addend(addend, n, x.device)
    lora_args, lora_consts = epilogue_args(lora, n, x.device, weight)
    assert not gated or n % 2 == 0, f"a gated weight stacks gate and up rows: {n} rows is odd"
    n_out = n // 2 if gated else n
    out, cfg, even = _plan(x, weight, weight_scale, k, n_out, config, "gated" if gated else "norm")
    summed = torch.empty_like(x)
    if n_out:
        _gemv_norm_kernel[(triton.cdiv(n_out, cfg.block_n),)](
            x, residual, norm_weight, summed, weight, weight_scale if weight_scale is not None else weight,
            addend if addend is not None else norm_weight, out, n_out, k, weight.stride(0), eps, *lora_args,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages, EVEN=even,
            HAS_SCALE=weight_scale is not None, HAS_ADDEND=addend is not None, GATED=gated, num_warps=cfg.num_warps,
            **lora_consts, **pdl_args(x.device))
    else:
        summed.copy_(x + residual)
    return out, summed
