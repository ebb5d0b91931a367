"""Per-token FP8 quantization of activations: one program per row computes the row's max |x|, its scale
`max|x| / FP8_MAX` and the saturated FP8 row, in one read of the row. It feeds the FP8 GEMMs
(`torch._scaled_mm`, `fp8_gemm`) at every layer of every step, so it is one launch with no host sync
(CUDA-graph capturable). Matches `fp8_ref.quantize_rows` bit for bit (IEEE divisions, RTNE cast).
"""

from __future__ import annotations

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
from radixmesh.kernels._fp8_cast import cast_fp8, emulate_cast
from radixmesh.kernels._jit import unspecialized
from radixmesh.kernels.fp8_ref import MIN_AMAX, fp8_limit

MAX_ROW_ELEMS = 32768
"""Widest row one program holds in registers (the 8B shape's widest input is 14,336)."""


@triton.jit(**unspecialized(ints=("K",)))
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, fp8_max, min_amax,
                          BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), min_amax)
    # round-to-nearest divisions, as the reference's: Triton 3.6 on an H100 compiled `tl.fdiv(..., ieee_rounding=True)`
    # to an approximate one (scales one ulp off now and then)
    scale = tl.math.div_rn(amax, fp8_max)
    q = tl.math.div_rn(x, scale)
    q = tl.minimum(tl.maximum(q, -fp8_max), fp8_max)
    tl.store(q_ptr + row * stride_q + offs, cast_fp8(q, q_ptr, EMULATE), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, out: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q [M, K] fp8, scale [M] float32)`, `x ~= q * scale[:, None]`, for activations `x` `[M, K]`.

    `out`/`scale` may be given (preallocated); `x` needs a contiguous last dim.
    """
    device = x.device
    check_device("x", x, device)
    assert x.dim() == 2, f"x must be [M, K], got shape {tuple(x.shape)}"
    check_float("x", x)
    check_last_dim_contiguous("x", x)
    rows, k = x.shape
    assert k <= MAX_ROW_ELEMS, f"rows of {k} elements exceed the kernel's {MAX_ROW_ELEMS}"
    if out is None:
        out = torch.empty((rows, k), dtype=dtype, device=device)
    if scale is None:
        scale = torch.empty(rows, dtype=torch.float32, device=device)
    check_device("out", out, device)
    check_device("scale", scale, device)
    check_fp8("out", out)
    assert tuple(out.shape) == (rows, k) and out.stride(-1) == 1, f"out must be [{rows}, {k}], contiguous rows"
    assert scale.dtype == torch.float32 and tuple(scale.shape) == (rows,) and scale.is_contiguous(), (
        f"scale must be a contiguous float32 [{rows}]")
    if rows == 0:
        return out, scale
    block = next_power_of_2(k)
    _quantize_rows_kernel[(rows,)](
        x, out, scale, k, x.stride(0), out.stride(0), fp8_limit(out.dtype), MIN_AMAX,
        BLOCK=block, EMULATE=emulate_cast(device), num_warps=min(16, max(1, block // 512)),
    )
    return out, scale
