"""Batch-1 linear layers `y = x @ W.T`: one row of activations against a weight matrix `[N, K]`.

A decode step at batch 1 is all reads of weights; the GEMM libraries treat it as a skinny GEMM
and, for the small square projections of a 1B model, leave bandwidth unused. Here each program
owns `BLOCK_N` output features and streams their weight rows (contiguous in `K`) through
registers, multiplying by the activations and summing in float32. No tensor cores: at one row
there is nothing for them to do.

`gemv_fp8` is the same loop over FP8 weights (half the bytes of bf16) with one float32 scale per
output row: the loop reads the FP8 tiles and widens them in registers, and each row's scale, being
constant along K, multiplies the row's sum once. Activations stay in their dtype (no activation
quantization at batch 1).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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
from radixmesh.kernels.lora_gemv import LoraEpilogue, epilogue_args, lora_epilogue


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def load_x_tile(x_ptr, cols, K, EVEN: tl.constexpr, EARLY: tl.constexpr):
    """A batch-1 GEMV's input row at `cols` (0 past K; `EVEN`: no column is); `EARLY` (read before the kernel's PDL
    wait, which the kernel before allows): from L2, past the SM's L1. The fused norm GEMVs read x and the residual
    with it too."""
    if EARLY:
        return tl.load(x_ptr + cols, mask=cols < K, other=0.0, cache_modifier=".cg")
    if EVEN:
        return tl.load(x_ptr + cols)
    return tl.load(x_ptr + cols, mask=cols < K, other=0.0)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_w,
                 xa_ptr, lb_ptr, lslots_ptr, lranks_ptr, lscalings_ptr, ln0, ln1, lsplits, lstride_split, lstride_bs,
                 lstride_bn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                 EVEN: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_LORA: tl.constexpr, R: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    # the first weight tile is loaded before waiting for the kernel that writes x (see radixmesh.kernels._pdl);
    # with an adapter the kernel before is its shrink, which lets this one read x at once: the wait comes before
    # the epilogue that reads the shrink's sums (radixmesh.kernels.lora_gemv)
    w = tl.load(rows + offs_k[None, :], mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0,
                eviction_policy="evict_first")
    if PDL and not HAS_LORA:
        gdc_wait()
    x = load_x_tile(x_ptr, offs_k, K, False, HAS_LORA)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=NUM_STAGES):
        cols = k + offs_k
        if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks in the loop
            w = tl.load(rows + cols[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(rows + cols[None, :], mask=(offs_n[:, None] < N) & (cols[None, :] < K), other=0.0,
                        eviction_policy="evict_first")
        x = load_x_tile(x_ptr, cols, K, EVEN, HAS_LORA)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    if PDL:
        gdc_launch_dependents()
        if HAS_LORA:
            gdc_wait()
    y = tl.sum(acc, axis=1)
    if HAS_SCALE:  # FP8 weights: one scale per output row
        y = y * tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)
    if HAS_LORA:  # the row's adapter (radixmesh.kernels.lora_gemv), before rounding
        y += lora_epilogue(xa_ptr, lb_ptr, lslots_ptr, lranks_ptr, lscalings_ptr, offs_n, offs_n < N, ln0, ln1,
                           lsplits, lstride_split, lstride_bs, lstride_bn, R, BLOCK_R, BLOCK_S)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


TUNED: dict[tuple[int, int], GemvConfig] = {
    # (N, K) -> the best of bench_gemv --sweep on an H100 (docs/benchmarks/h100-gemv.jsonl)
    (3072, 2048): GemvConfig(4, 256, 4, 4), (2048, 2048): GemvConfig(8, 512, 4, 4),
    (16384, 2048): GemvConfig(8, 256, 4, 4), (2048, 8192): GemvConfig(4, 512, 4, 4),
    (128256, 2048): GemvConfig(4, 1024, 4, 2), (6144, 4096): GemvConfig(4, 1024, 4, 2),
    (4096, 4096): GemvConfig(4, 256, 4, 4), (28672, 4096): GemvConfig(4, 1024, 4, 2),
    (4096, 14336): GemvConfig(4, 256, 4, 4), (128256, 4096): GemvConfig(4, 1024, 8, 4),
}


def default_config(n: int, k: int) -> GemvConfig:
    """The tuned configuration of this shape, else: 4 rows a program (many programs), K in
    tiles of up to 512, four loads in flight, the pattern that won most tuned shapes."""
    tuned = TUNED.get((n, k))
    if tuned is not None:
        return tuned
    return GemvConfig(4, max(64, min(512, next_power_of_2(k))), 4, 4)


def gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
         config: GemvConfig | None = None, lora: LoraEpilogue | None = None) -> torch.Tensor:
    """`x @ weight.T` for `x` of shape `[1, K]` or `[K]` and `weight` `[N, K]`; returns `[1, N]` or `[N]`; with
    `lora` (from `lora_gemv_shrink` of x), plus the row's adapter output."""
    assert x.dim() in (1, 2) and (x.dim() == 1 or x.shape[0] == 1), f"x must be [K] or [1, K], got {tuple(x.shape)}"
    assert weight.dim() == 2, f"weight must be [N, K], got {tuple(weight.shape)}"
    n, k = weight.shape
    assert x.shape[-1] == k, f"x has {x.shape[-1]} features, weight expects {k}"
    check_device("weight", weight, x.device)
    check_float("x", x)
    check_float("weight", weight)
    assert x.dtype == weight.dtype, f"x is {x.dtype}, weight is {weight.dtype}"
    check_last_dim_contiguous("weight", weight)
    assert x.is_contiguous(), "x must be contiguous"
    shape = (*x.shape[:-1], n)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    assert tuple(out.shape) == shape and out.dtype == x.dtype and out.is_contiguous(), (
        f"out must be a contiguous {x.dtype} tensor of shape {shape}")
    check_device("out", out, x.device)
    if n == 0:
        return out
    cfg = config or fused_config("plain", n, k, fp8=False)
    even = n % cfg.block_n == 0 and k % cfg.block_k == 0
    lora_args, lora_consts = epilogue_args(lora, n, x.device, weight)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, weight, out, n, k, weight.stride(0), *lora_args,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages, EVEN=even, HAS_SCALE=False,
        num_warps=cfg.num_warps, **lora_consts, **pdl_args(x.device),
    )
    return out


TUNED_FP8: dict[tuple[int, int], GemvConfig] = {
    # (N, K) -> the best of `bench_fp8 --gemv-sweep` on an H100 (docs/benchmarks/h100-fp8-kernel-2026-11-26.jsonl)
    (6144, 4096): GemvConfig(16, 512, 4, 4), (4096, 4096): GemvConfig(8, 512, 4, 4),
    (28672, 4096): GemvConfig(8, 512, 4, 4), (4096, 14336): GemvConfig(8, 512, 4, 4),
}


def default_config_fp8(n: int, k: int) -> GemvConfig:
    """The tuned FP8 configuration of this shape, else the pattern that won three of the four tuned 8B
    shapes: 8 rows a program, K in tiles of up to 512."""
    tuned = TUNED_FP8.get((n, k))
    if tuned is not None:
        return tuned
    return GemvConfig(8, max(64, min(512, next_power_of_2(k))), 4, 4)


TUNED_FUSED: dict[tuple[str, str, int, int], GemvConfig] = {
    # (kind, weights, N, K) -> the best of `bench_gemv_fused --sweep` on an H100, for the kernels as a decode step
    # launches them (kind: plain, gated, rope; docs/benchmarks/h100-gemv-fused-2026-11-26.jsonl). Llama-3.1-8B:
    ("rope", "fp8", 6144, 4096): GemvConfig(16, 512, 4, 3), ("plain", "fp8", 4096, 4096): GemvConfig(4, 1024, 2, 3),
    ("gated", "fp8", 28672, 4096): GemvConfig(16, 256, 2, 3), ("plain", "fp8", 4096, 14336): GemvConfig(8, 1024, 4, 3),
    ("rope", "bf16", 6144, 4096): GemvConfig(16, 256, 4, 3), ("plain", "bf16", 4096, 4096): GemvConfig(4, 512, 4, 3),
    ("plain", "bf16", 4096, 14336): GemvConfig(4, 512, 2, 3),
    # one rank of Llama-3.1-8B at tensor-parallel size 2
    ("rope", "bf16", 3072, 4096): GemvConfig(4, 512, 2, 3), ("plain", "bf16", 4096, 2048): GemvConfig(4, 512, 4, 3),
    ("gated", "bf16", 14336, 4096): GemvConfig(4, 1024, 2, 3), ("plain", "bf16", 4096, 7168): GemvConfig(4, 512, 2, 3),
    ("plain", "bf16", 64128, 4096): GemvConfig(8, 1024, 8, 4),
    # Qwen3-30B-A3B on an H200 (docs/benchmarks/h200-qwen3-gemv-2026-11-29.jsonl): o 5.91 us (6.30 at the default
    # tiles), the router with its norm 2.96 (3.36), lm_head 138.1 (139.1); the norm + q/k/v 7.78 (10.18,
    # h200-qwen3-gemv-2026-11-29b.jsonl)
    ("plain", "bf16", 2048, 4096): GemvConfig(8, 512, 2, 4), ("router", "bf16", 128, 2048): GemvConfig(4, 1024, 4, 3),
    ("plain", "bf16", 151936, 2048): GemvConfig(8, 256, 2, 3), ("norm", "bf16", 5120, 2048): GemvConfig(8, 512, 2, 3),
}


def parse_tiles(value: str | None) -> dict[tuple[str, str, int, int], GemvConfig]:
    """Tiles that replace the tuned ones for a kind and shape (`RADIXMESH_GEMV_TILES`, for sweeps inside a model):
    `;`-separated `kind[/fp8]:NxK=block_n,block_k,num_warps,num_stages` (e.g. `plain:2048x4096=8,4096,8,1`);
    ValueError naming the item that does not read."""
    out: dict[tuple[str, str, int, int], GemvConfig] = {}
    for item in (value or "").split(";"):
        if not item.strip():
            continue
        try:
            key, tiles = item.split("=")
            kind, shape = key.strip().split(":")
            kind, _, weights = kind.partition("/")
            n, k = (int(v) for v in shape.lower().split("x"))
            bn, bk, warps, stages = (int(v) for v in tiles.split(","))
        except ValueError:
            raise ValueError(f"cannot read {item.strip()!r}: expected "
                             "kind[/fp8]:NxK=block_n,block_k,num_warps,num_stages") from None
        if weights not in ("", "fp8") or min(n, k, bn, bk, warps, stages) < 1:
            raise ValueError(f"cannot read {item.strip()!r}: weights are bf16 (no suffix) or /fp8, and every number "
                             "is positive")
        out[(kind.strip(), weights or "bf16", n, k)] = GemvConfig(bn, bk, warps, stages)
    return out


TILES_OVERRIDE: dict[tuple[str, str, int, int], GemvConfig] = {}
"""Tiles ahead of `TUNED_FUSED` (`set_tiles`; the model runner sets them from RADIXMESH_GEMV_TILES)."""


def set_tiles(tiles: Mapping[tuple[str, str, int, int], GemvConfig]) -> None:
    """Launch the batch-1 GEMVs of these (kind, weights, N, K) with these tiles from now on (empty: the tuned)."""
    TILES_OVERRIDE.clear()
    TILES_OVERRIDE.update(tiles)


def fused_config(kind: str, n: int, k: int, fp8: bool) -> GemvConfig:
    """The tiles of a batch-1 GEMV of `kind` (plain, norm, gated, rope, router) over an `[n, k]` weight: those
    `set_tiles` gave, else tuned for that kernel where measured, else the plain GEMV's choice."""
    key = (kind, "fp8" if fp8 else "bf16", n, k)
    tuned = TILES_OVERRIDE.get(key) or TUNED_FUSED.get(key)
    if tuned is not None:
        return tuned
    return default_config_fp8(n, k) if fp8 else default_config(n, k)


def gemv_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out: torch.Tensor | None = None,
             config: GemvConfig | None = None) -> torch.Tensor:
    """`x @ (weight * weight_scale[:, None]).T` for `x` `[1, K]` or `[K]` (bf16/fp16/fp32), `weight`
    `[N, K]` FP8 and `weight_scale` `[N]` float32; returns `[1, N]` or `[N]` in `x`'s dtype."""
    assert x.dim() in (1, 2) and (x.dim() == 1 or x.shape[0] == 1), f"x must be [K] or [1, K], got {tuple(x.shape)}"
    assert weight.dim() == 2, f"weight must be [N, K], got {tuple(weight.shape)}"
    n, k = weight.shape
    assert x.shape[-1] == k, f"x has {x.shape[-1]} features, weight expects {k}"
    check_device("weight", weight, x.device)
    check_device("weight_scale", weight_scale, x.device)
    check_float("x", x)
    check_fp8("weight", weight)
    assert weight_scale.dtype == torch.float32 and tuple(weight_scale.shape) == (n,) and weight_scale.is_contiguous(), (
        f"weight_scale must be a contiguous float32 [{n}], got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    check_last_dim_contiguous("weight", weight)
    assert x.is_contiguous(), "x must be contiguous"
    shape = (*x.shape[:-1], n)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    assert tuple(out.shape) == shape and out.dtype == x.dtype and out.is_contiguous(), (
        f"out must be a contiguous {x.dtype} tensor of shape {shape}")
    check_device("out", out, x.device)
    if n == 0:
        return out
    cfg = config or fused_config("plain", n, k, fp8=True)
    even = n % cfg.block_n == 0 and k % cfg.block_k == 0
    lora_args, lora_consts = epilogue_args(None, n, x.device, weight_scale)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, weight_scale, out, n, k, weight.stride(0), *lora_args,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages, EVEN=even, HAS_SCALE=True,
        num_warps=cfg.num_warps, **lora_consts, **pdl_args(x.device),
    )
    return out
