"""The CPU path of `Linear` (weight-major GEMM for a few rows) computes what `nn.functional.linear` does."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.models.layers import WEIGHT_MAJOR_MAX_ROWS, Linear


@pytest.mark.parametrize("rows", [1, 2, 3, 17, WEIGHT_MAJOR_MAX_ROWS, WEIGHT_MAJOR_MAX_ROWS + 1, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_functional_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    layer = Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    y = layer(x)
    assert y.shape == (rows, 160) and y.is_contiguous()
    torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_other_dtypes_and_shapes_take_the_default_path() -> None:
    layer = Linear(8, 4, bias=False).to(torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
    x3 = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    assert layer(x3).shape == (2, 3, 4)
