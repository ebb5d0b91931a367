"""Launcher-side checks shared by the kernels: devices, dtypes, shapes and strides, with clear messages."""

from __future__ import annotations

import os

import torch
import triton.language as tl

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""Storage dtypes of FP8 weights and KV pools: values are stored scaled, read as `fp8 * scale`."""
KV_DTYPES = FLOAT_DTYPES + FP8_DTYPES
INDEX_DTYPES = (torch.int32, torch.int64)


def check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    assert tensor.device == device, f"{name} is on {tensor.device}, expected {device} (all inputs on one device)"
    if device.type == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1", (
            f"{name} is a CPU tensor: Triton kernels run on CPU only under TRITON_INTERPRET=1 "
            "(set it before triton is imported)")
    else:
        assert device.type == "cuda", f"{name} is on {device}: Triton kernels need CUDA (or CPU under the interpreter)"


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    assert tuple(tensor.shape) == expected, f"{name} has shape {tuple(tensor.shape)}, expected {expected}"


def check_float(name: str, tensor: torch.Tensor) -> None:
    assert tensor.dtype in FLOAT_DTYPES, f"{name} has dtype {tensor.dtype}, expected one of {FLOAT_DTYPES}"


def check_kv(name: str, tensor: torch.Tensor) -> None:
    """A KV pool buffer: a float dtype, or FP8 (read and written through a per-tensor scale)."""
    assert tensor.dtype in KV_DTYPES, f"{name} has dtype {tensor.dtype}, expected one of {KV_DTYPES}"


def check_fp8(name: str, tensor: torch.Tensor) -> None:
    assert tensor.dtype in FP8_DTYPES, f"{name} has dtype {tensor.dtype}, expected one of {FP8_DTYPES}"


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2); values are clamped to it."""
    return float(torch.finfo(dtype).max)


def check_index(name: str, tensor: torch.Tensor) -> None:
    assert tensor.dtype in INDEX_DTYPES, f"{name} has dtype {tensor.dtype}, expected int32 or int64"
    assert tensor.dim() == 1, f"{name} must be 1-D, got shape {tuple(tensor.shape)}"
    assert tensor.numel() <= 1 or tensor.stride(0) == 1, f"{name} must be contiguous, got stride {tensor.stride()}"


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    assert tensor.shape[-1] <= 1 or tensor.stride(-1) == 1, (
        f"{name} must have a contiguous last dim (stride 1), got strides {tensor.stride()}")


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def dot_dtype(dtype: torch.dtype, device: torch.device) -> tl.dtype:
    """Operand dtype for `tl.dot`: the input dtype, except bf16 under the CPU interpreter.

    The interpreter's `tl.dot` mishandles bf16 operands (it multiplies the raw bits), so on
    CPU bf16 tiles are widened to fp32 first; on the GPU bf16 goes to the tensor cores as is.
    """
    if dtype == torch.bfloat16 and device.type == "cpu":
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def dot_precision(dtype: tl.dtype) -> str:
    """fp32 operands use exact fp32 products (`ieee`), matching the PyTorch reference, not TF32."""
    return "ieee" if dtype == tl.float32 else "tf32"
