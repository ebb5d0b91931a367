"""`bench_lora`'s `layer-1` case (`radixmesh.kernels.bench_lora_gemv`) at tiny shapes under the Triton interpreter
without CUDA: every kernel set's launches, as a batch-1 step runs them, give the float32 reference's output with
the adapter (q/k/v with the rotary store, o, gate/up with SiLU-and-mul, down)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.kernels.bench_lora import case_kernels
from radixmesh.kernels.bench_lora_gemv import check, launches, make_projection

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS = (2, 1, 16)
SHAPES = [(64, (32, 16, 16), "rope"), (32, (64,), "plain"), (64, (48, 48), "gated")]


@pytest.mark.parametrize("kernels", ["epilogue", "rows", "fused"])
@pytest.mark.parametrize("k,slices,kind", SHAPES)
def test_each_kernel_set_gives_the_reference(k: int, slices: tuple[int, ...], kind: str, kernels: str) -> None:
    torch.manual_seed(0)
    p = make_projection(k, slices, kind, 8, 16, DEVICE, HEADS, span_bytes=0)
    p.adapters = [(a * 5, b * 5) for a, b in p.adapters]  # an adapter well above bf16 rounding of the output
    assert len(p.weights) == 2 and check(p, kernels) < 0.05
    base = launches(p, None)().float()
    assert float((launches(p, kernels)().float() - base).norm()) > 0, "the adapter changes the output"


@pytest.mark.parametrize("width", [16, 64])
def test_the_epilogue_at_each_width_gives_the_reference(width: int) -> None:
    """--epilogue-widths: the shrink split for `width` partial sums a row (1 and 2 splits here on the CPU) still
    adds the adapter."""
    torch.manual_seed(0)
    p = make_projection(64, (64,), "plain", 8, 16, DEVICE, HEADS, span_bytes=0)
    p.adapters = [(a * 5, b * 5) for a, b in p.adapters]
    assert check(p, "epilogue", width) < 0.05


def test_the_cases_kernel_sets() -> None:
    sets = ["rows", "fused", "epilogue"]
    assert case_kernels("layer-1", sets) == sets
    assert case_kernels("decode", sets) == ["rows", "fused"] and case_kernels("prefill", sets) == ["rows"]
