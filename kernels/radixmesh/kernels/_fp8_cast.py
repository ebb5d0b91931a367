"""The float32 -> FP8 cast of every kernel that writes FP8 (activation quantization, KV stores).

On a GPU it is the hardware conversion (round to nearest even). Triton's CPU interpreter rounds FP8
wrongly (half away from zero, and a mantissa carry does not reach the exponent: 127.9 becomes 64), so
under the interpreter values are first rounded to the nearest FP8 value in float32 with integer
arithmetic, after which the interpreter's cast is exact. The tests on CPU thus check the kernels'
logic with correct rounding, and the GPU runs the plain cast.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def emulate_cast(device: torch.device) -> bool:
    """Whether kernels on `device` must round to FP8 themselves (the CPU interpreter)."""
    return device.type == "cpu" or os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _round_to_fp8_grid(x, MANTISSA: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr):
    """`x` (float32, within the FP8 range) rounded to the nearest value with MANTISSA bits, ties to even;
    below 2**MIN_NORMAL_EXP to the subnormal grid 2**(MIN_NORMAL_EXP - MANTISSA)."""
    drop: tl.constexpr = 23 - MANTISSA
    half_ulp: tl.constexpr = (1 << (drop - 1)) - 1
    keep: tl.constexpr = 0xFFFFFFFF ^ ((1 << drop) - 1)
    bits = x.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    lsb = (mag >> drop) & 1
    normal = ((mag + half_ulp + lsb) & keep).to(tl.float32, bitcast=True)
    # adding 1.5 * 2**(23 + e) rounds to a multiple of 2**e (float32 addition rounds to nearest even)
    magic: tl.constexpr = 1.5 * (2.0 ** (23 + MIN_NORMAL_EXP - MANTISSA))
    a = mag.to(tl.float32, bitcast=True)
    rounded = tl.where(a < 2.0 ** MIN_NORMAL_EXP, (a + magic) - magic, normal)
    return (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def cast_fp8(x, dst_ptr, EMULATE: tl.constexpr):
    """`x` (float32, already clamped to the FP8 range) as the element type of `dst_ptr` (an FP8 pointer)."""
    if EMULATE:
        if dst_ptr.dtype.element_ty == tl.float8e5:
            x = _round_to_fp8_grid(x, 2, -14)
        else:
            x = _round_to_fp8_grid(x, 3, -6)
    return x.to(dst_ptr.dtype.element_ty)
