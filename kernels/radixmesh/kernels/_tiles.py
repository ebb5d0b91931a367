"""Tile arithmetic shared by the grouped and segmented GEMMs (MoE, LoRA)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mma(a, w, acc, USE_DOT: tl.constexpr, A_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """`acc + a @ w` for `a` `[BM, BK]`, `w` `[BK, BN]` with a float32 `acc`.

    With `USE_DOT` (tiles of 16+ rows) on the tensor cores: FP8 x FP8 as is when `A_FP8`, else both
    operands in `DOT_DTYPE` (FP8 weights widened). Without (1..8 rows: decode) products are summed in
    float32 registers, as the GEMV does: a tensor-core tile would be mostly padding there.
    """
    if USE_DOT:
        if A_FP8:
            acc = tl.dot(a, w, acc)
        else:
            acc = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=PRECISION)
    else:
        acc += tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
    return acc
