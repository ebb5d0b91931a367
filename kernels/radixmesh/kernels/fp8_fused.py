"""The kernels that produce an FP8 GEMM's input, with its per-token quantization inside them.

With FP8 weights every projection's activations are quantized per token before the GEMM
(`fp8_quant.quantize_rows`): a launch of its own that reads back the row the kernel before it
just wrote. Three of a decoder layer's four projections take their input from a kernel that
already holds the whole row in registers: the RMSNorm before q/k/v and before gate/up, and
SiLU-and-mul before down. These variants finish that row as those kernels do (the same
roundings to the activation dtype, `fused.py`), then take its max |x|, its scale and the saturated
FP8 row, as `quantize_rows` does: the output is bit for bit `quantize_rows(rms_norm(...))` and
`quantize_rows(silu_and_mul(...))`, in one launch and one write of one byte per element.
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
    check_shape,
    next_power_of_2,
)
from radixmesh.kernels._fp8_cast import cast_fp8, emulate_cast
from radixmesh.kernels.fp8_quant import MAX_ROW_ELEMS
from radixmesh.kernels.fp8_ref import MIN_AMAX, fp8_limit


@triton.jit
def _quantize_row(y, mask, q_row_ptr, s_ptr, fp8_max, min_amax, EMULATE: tl.constexpr):
    """Store `y` (float32, one row) as FP8 with its scale `max|y| / fp8_max` (as `_quantize_rows_kernel`)."""
    amax = tl.maximum(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0), min_amax)
    scale = tl.math.div_rn(amax, fp8_max)
    q = tl.math.div_rn(y, scale)
    q = tl.minimum(tl.maximum(q, -fp8_max), fp8_max)
    tl.store(q_row_ptr, cast_fp8(q, q_row_ptr, EMULATE), mask=mask)
    tl.store(s_ptr, scale)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr,
    stride_x, stride_res, stride_q, stride_res_out,
    hidden, eps, fp8_max, min_amax,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, EMULATE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    act = x_ptr.dtype.element_ty
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * rstd).to(act).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(act).to(tl.float32)  # the row `rms_norm` would have stored
    _quantize_row(y, mask, q_ptr + row * stride_q + offs, s_ptr + row, fp8_max, min_amax, EMULATE)


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, width, fp8_max, min_amax,
                               BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    act = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(act).to(tl.float32)
    y = (silu * up).to(act).to(tl.float32)  # the row `silu_and_mul` would have stored
    _quantize_row(y, mask, q_ptr + row * stride_q + offs, s_ptr + row, fp8_max, min_amax, EMULATE)


def can_fuse(width: int) -> bool:
    """Whether one program can hold a row of `width` elements (else quantize in a launch of its own)."""
    return 1 <= width <= MAX_ROW_ELEMS


def _outputs(rows: int, width: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty((rows, width), dtype=dtype, device=device)
    check_fp8("out", q)
    return q, torch.empty(rows, dtype=torch.float32, device=device)


def _num_warps(block: int) -> int:
    return min(16, max(1, block // 512))


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`(q [rows, hidden] fp8, scale [rows] float32, new_residual)`: `quantize_rows(rms_norm(x, weight, eps,
    residual)[0])` and `rms_norm`'s `x + residual` (None without a residual), in one launch."""
    device = x.device
    check_device("x", x, device)
    check_device("weight", weight, device)
    assert x.dim() == 2, f"x must be [rows, hidden], got shape {tuple(x.shape)}"
    rows, hidden = x.shape
    assert can_fuse(hidden), f"rows of {hidden} elements exceed the kernel's {MAX_ROW_ELEMS}"
    check_shape("weight", weight, (hidden,))
    check_float("x", x)
    check_float("weight", weight)
    check_last_dim_contiguous("x", x)
    assert weight.stride(0) == 1 or hidden == 1, f"weight must be contiguous, got stride {weight.stride()}"
    q, scale = _outputs(rows, hidden, dtype, device)
    res_out = None
    if residual is not None:
        check_device("residual", residual, device)
        check_shape("residual", residual, (rows, hidden))
        assert residual.dtype == x.dtype, f"residual has dtype {residual.dtype}, x has {x.dtype}"
        check_last_dim_contiguous("residual", residual)
        res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows == 0:
        return q, scale, res_out
    block = next_power_of_2(hidden)
    _rms_norm_quant_kernel[(rows,)](
        x, residual if residual is not None else x, weight, q, scale, res_out if res_out is not None else x,
        x.stride(0), residual.stride(0) if residual is not None else 0, q.stride(0),
        res_out.stride(0) if res_out is not None else 0,
        hidden, eps, fp8_limit(dtype), MIN_AMAX,
        HAS_RESIDUAL=residual is not None, BLOCK=block, EMULATE=emulate_cast(device), num_warps=_num_warps(block),
    )
    return q, scale, res_out


def silu_and_mul_quant(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q [rows, width] fp8, scale [rows] float32)`: `quantize_rows(silu_and_mul(x))` for `x = [gate | up]`
    `[rows, 2 * width]`, in one launch."""
    device = x.device
    check_device("x", x, device)
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [rows, 2 * width], got shape {tuple(x.shape)}"
    check_float("x", x)
    check_last_dim_contiguous("x", x)
    rows, width = x.shape[0], x.shape[1] // 2
    assert can_fuse(width), f"rows of {width} elements exceed the kernel's {MAX_ROW_ELEMS}"
    q, scale = _outputs(rows, width, dtype, device)
    if rows == 0:
        return q, scale
    block = next_power_of_2(width)
    _silu_and_mul_quant_kernel[(rows,)](
        x, q, scale, x.stride(0), q.stride(0), width, fp8_limit(dtype), MIN_AMAX,
        BLOCK=block, EMULATE=emulate_cast(device), num_warps=_num_warps(block),
    )
    return q, scale
