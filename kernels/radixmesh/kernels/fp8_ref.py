"""FP8 quantization in plain PyTorch: the CPU path of FP8 linear layers and KV pools, and the reference
the Triton kernels (`fp8_quant`, `fp8_gemm`, the FP8 GEMV, the FP8 KV stores) are tested against.

Scaled FP8: a value `x` is stored as `q = fp8(x / scale)` and read as `q * scale`. Rows (a weight's
output channels, an activation's tokens) get their own scale `max|row| / FP8_MAX`, so every row uses
the whole FP8 range; the KV pool uses one scale per tensor. Importing this module compiles no kernel.
"""

from __future__ import annotations

import torch

MIN_AMAX = 1e-12
"""Floor of a row's max |x| before it becomes a scale: an all-zero row quantizes to zeros, not NaN."""


def fp8_limit(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype; quantized values are clamped to +-it (saturation)."""
    return float(torch.finfo(dtype).max)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q [rows, K] fp8, scale [rows] float32)` with `x ~= q * scale[:, None]`, one scale per row of `x`
    `[rows, K]`: per output channel for a weight `[N, K]`, per token for activations `[M, K]`."""
    assert x.dim() == 2, f"x must be [rows, K], got {tuple(x.shape)}"
    limit = fp8_limit(dtype)
    x32 = x.float()
    scale = x32.abs().amax(dim=1).clamp(min=MIN_AMAX) / limit  # [rows]
    q = (x32 / scale[:, None]).clamp(-limit, limit).to(dtype)
    return q, scale


def quantize_scaled(x: torch.Tensor, inv_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """`fp8(x * inv_scale)`, saturated: a KV pool's per-tensor quantization (`inv_scale = 1 / scale`)."""
    limit = fp8_limit(dtype)
    return (x.float() * inv_scale).clamp(-limit, limit).to(dtype)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`q * scale[:, None]` in `dtype`: what a quantized weight `[N, K]` stands for."""
    return (q.float() * scale.float().reshape(-1, 1)).to(dtype)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T (+ bias)` of a W8A8 linear layer as the GPU runs it, in float32 on any device.

    `x` `[M, K]` (float) is quantized per token to the weight's FP8 dtype; `weight` `[N, K]` is FP8
    with `weight_scale` `[N]`. Products accumulate in float32 and both scales apply afterwards (the
    epilogue of `torch._scaled_mm` and of `fp8_gemm`); the result has `x`'s dtype.
    """
    assert weight.dim() == 2 and x.dim() == 2 and x.shape[1] == weight.shape[1], (
        f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not chain")
    xq, xs = quantize_rows(x, weight.dtype)
    acc = torch.mm(xq.float(), weight.float().t())  # [M, N]
    y = acc * xs[:, None] * weight_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fp8_gemv_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The FP8-weight GEMV's result: activations stay in their dtype (no activation quantization),
    weights are read as `fp8 * scale`; float32 accumulation; `x`'s dtype out."""
    y = (x.float() @ weight.float().t()) * weight_scale.float()
    return y.to(x.dtype)
