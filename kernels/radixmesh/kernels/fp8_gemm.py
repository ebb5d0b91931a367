"""W8A8 FP8 GEMM `y = (a * a_scale[:, None]) @ (w * w_scale[:, None]).T`, the alternative to
`torch._scaled_mm` (row-wise scales) where that is unsupported or slower (the engine measures both
per shape at load: `radixmesh.engine.quant.gemm_plan`).

`a` `[M, K]` are activations quantized per token (`fp8_quant.quantize_rows`), `w` `[N, K]` a weight
quantized per output channel; products accumulate in float32 on the tensor cores and both scales
apply in the epilogue. Tiles are grouped along M so that programs running together share weight
tiles in L2. Tile sizes are picked from M (`default_config`), never autotuned at run time: a new M
must not start a benchmark in the middle of serving or of a CUDA-graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import check_device, check_fp8, check_last_dim_contiguous
from radixmesh.kernels._jit import unspecialized

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4


@triton.jit(**unspecialized(ints=("M",)))
def _fp8_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, y_ptr, M, N, K, stride_a, stride_w, stride_y,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_rows
    pid_n = (pid % group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows past M / N read row 0 / N-1 again (no masks in the loop); their results are not stored
    rows_a = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rows_w = tl.where(offs_n < N, offs_n, N - 1).to(tl.int64)
    a_ptrs = a_ptr + rows_a[:, None] * stride_a + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + rows_w[None, :] * stride_w + offs_k[:, None]  # [BLOCK_K, BLOCK_N]: W.T, K-major
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(k + offs_k)[None, :] < K, other=0.0)
            w = tl.load(w_ptrs, mask=(k + offs_k)[:, None] < K, other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    a_scale = tl.load(a_scale_ptr + rows_a)
    w_scale = tl.load(w_scale_ptr + rows_w)
    y = acc * a_scale[:, None] * w_scale[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_y + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


def default_config(m: int, n: int, k: int, device: torch.device) -> Fp8GemmConfig:
    """Tiles by M: narrow for decode batches (many programs over N), square for prefill. Blocks of 64+
    rows keep Hopper's warp-group MMA; the CPU interpreter gets small tiles."""
    if device.type == "cpu":
        return Fp8GemmConfig(16, 32, 32, 4, 1, 1)
    if m <= 64:
        return Fp8GemmConfig(64, 64, 128, 8, 4, 4)
    if m <= 256:
        return Fp8GemmConfig(64, 128, 128, 8, 4, 4)
    return Fp8GemmConfig(128, 128, 128, 8, 8, 3)


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
             config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """`[M, N]` in `out_dtype`: `a` `[M, K]` FP8 with `a_scale` `[M]` float32, `w` `[N, K]` FP8 (same
    FP8 dtype) with `w_scale` `[N]` float32."""
    device = a.device
    for name, t in (("a", a), ("a_scale", a_scale), ("w", w), ("w_scale", w_scale)):
        check_device(name, t, device)
    assert a.dim() == 2 and w.dim() == 2, f"a must be [M, K] and w [N, K], got {tuple(a.shape)}, {tuple(w.shape)}"
    m, k = a.shape
    n = w.shape[0]
    assert w.shape[1] == k, f"a has {k} features, w expects {w.shape[1]}"
    check_fp8("a", a)
    check_fp8("w", w)
    assert a.dtype == w.dtype, f"a is {a.dtype}, w is {w.dtype}"
    check_last_dim_contiguous("a", a)
    check_last_dim_contiguous("w", w)
    for name, t, rows in (("a_scale", a_scale, m), ("w_scale", w_scale, n)):
        assert t.dtype == torch.float32 and tuple(t.shape) == (rows,) and t.is_contiguous(), (
            f"{name} must be a contiguous float32 [{rows}], got {t.dtype} {tuple(t.shape)}")
    assert out_dtype in OUT_DTYPES, f"out_dtype {out_dtype} is not one of {OUT_DTYPES}"
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=device)
    check_device("out", out, device)
    assert out.dtype == out_dtype and tuple(out.shape) == (m, n) and out.stride(-1) == 1, (
        f"out must be a {out_dtype} [{m}, {n}] with contiguous rows")
    if m == 0 or n == 0:
        return out
    cfg = config or default_config(m, n, k, device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fp8_gemm_kernel[grid](
        a, a_scale, w, w_scale, out, m, n, k, a.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
