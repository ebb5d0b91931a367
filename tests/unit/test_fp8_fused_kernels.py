"""RMSNorm and SiLU-and-mul with the FP8 quantization of their output inside: bit for bit the unfused pair
(`fused.rms_norm` / `fused.silu_and_mul`, then `fp8_quant.quantize_rows`), at small shapes.

Without CUDA the kernels run on CPU under the Triton interpreter; tests/gpu/test_fp8_fused_gpu.py runs them
compiled at the 8B shape's widths.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.engine.models.layers import RMSNorm
from radixmesh.kernels.fp8_fused import can_fuse, rms_norm_quant, silu_and_mul_quant
from radixmesh.kernels.fp8_quant import MAX_ROW_ELEMS, quantize_rows
from radixmesh.kernels.fp8_ref import dequantize_rows
from radixmesh.kernels.fused import rms_norm, silu_and_mul

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _assert_same_fp8(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert got[0].dtype == want[0].dtype and got[1].dtype == torch.float32
    assert torch.equal(got[1].cpu(), want[1].cpu())
    assert torch.equal(got[0].view(torch.uint8).cpu(), want[0].view(torch.uint8).cpu())


def _assert_within_fp8_rounding(q: torch.Tensor, s: torch.Tensor, want: torch.Tensor) -> None:
    """`q * s` is `want` up to one FP8 step (a relative 2**-3 for e4m3, 2**-2 for e5m2; subnormals near 0)."""
    rel = 2**-3 if q.dtype == E4M3 else 2**-2
    got = dequantize_rows(q.cpu(), s.cpu(), torch.float32)
    torch.testing.assert_close(got, want.float(), rtol=rel, atol=float(s.max()) * 2**-6)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype,hidden", [(torch.bfloat16, 96), (torch.float16, 200), (torch.float32, 33)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_quant_is_the_unfused_pair(fp8: torch.dtype, dtype: torch.dtype, hidden: int,
                                            with_residual: bool) -> None:
    x = _rand(6, hidden, seed=hidden, scale=2.0).to(dtype).to(DEVICE)
    x[3] = 0  # an all-zero row (without a residual: the scale floor)
    x[1, 7] = 300.0  # an outlier sets its row's scale
    residual = _rand(6, hidden, seed=hidden + 1).to(dtype).to(DEVICE) if with_residual else None
    weight = (1 + _rand(hidden, seed=2, scale=0.1)).to(dtype).to(DEVICE)
    q, s, summed = rms_norm_quant(x, weight, 1e-5, residual, fp8)
    normed, summed_ref = rms_norm(x, weight, 1e-5, residual)
    _assert_same_fp8((q, s), quantize_rows(normed, fp8))
    if with_residual:
        assert summed is not None and summed_ref is not None and torch.equal(summed, summed_ref)
    else:
        assert summed is None
    layer = RMSNorm(hidden, 1e-5).to(dtype)  # the PyTorch layer: within FP8's rounding of it
    layer.weight.data.copy_(weight.cpu())
    _assert_within_fp8_rounding(q, s, layer((x + residual if residual is not None else x).cpu()).detach())


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype,width", [(torch.bfloat16, 80), (torch.float16, 257), (torch.float32, 16)])
def test_silu_and_mul_quant_is_the_unfused_pair(fp8: torch.dtype, dtype: torch.dtype, width: int) -> None:
    x = _rand(5, 2 * width, seed=width, scale=3.0).to(dtype).to(DEVICE)
    x[2] = 0
    x[4, 1] = 40.0  # a large gate: SiLU passes it through
    q, s = silu_and_mul_quant(x, fp8)
    _assert_same_fp8((q, s), quantize_rows(silu_and_mul(x), fp8))
    gate, up = x.cpu().float().chunk(2, dim=-1)
    _assert_within_fp8_rounding(q, s, (torch.nn.functional.silu(gate) * up).to(dtype))


def test_strided_rows_and_empty_batches() -> None:
    base = _rand(4, 128, seed=5).to(torch.bfloat16).to(DEVICE)
    x = base[:, :64]  # rows with a stride of 128
    weight = torch.ones(64, dtype=torch.bfloat16, device=DEVICE)
    q, s, _ = rms_norm_quant(x, weight, 1e-6)
    _assert_same_fp8((q, s), quantize_rows(rms_norm(x.contiguous(), weight, 1e-6)[0]))
    q, s = silu_and_mul_quant(base[:, :100])  # [gate | up] of width 50 inside wider rows
    _assert_same_fp8((q, s), quantize_rows(silu_and_mul(base[:, :100].contiguous())))
    empty = torch.empty(0, 64, dtype=torch.bfloat16, device=DEVICE)
    assert rms_norm_quant(empty, weight, 1e-6)[0].shape == (0, 64)
    assert silu_and_mul_quant(empty)[0].shape == (0, 32)


def test_launchers_check_their_inputs() -> None:
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(AssertionError, match="weight has shape"):
        rms_norm_quant(x, torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(AssertionError, match="expected one of"):
        rms_norm_quant(x, torch.ones(8, device=DEVICE), 1e-6, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="residual has dtype"):
        rms_norm_quant(x, torch.ones(8, device=DEVICE), 1e-6, torch.zeros(2, 8, dtype=torch.float16, device=DEVICE))
    with pytest.raises(AssertionError, match=r"2 \* width"):
        silu_and_mul_quant(torch.zeros(2, 7, device=DEVICE))
    assert can_fuse(MAX_ROW_ELEMS) and not can_fuse(MAX_ROW_ELEMS + 1)
