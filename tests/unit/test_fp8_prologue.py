"""How a projection runs the step before it (`Linear.forward(x, prologue)`): inside the quantization method's
input step where that runs (FP8 on CUDA: the norm or SiLU kernel quantizes its own output), else on its own."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from radixmesh.engine.models.layers import SILU_AND_MUL, AddRMSNorm, GatedMLP, Linear, Prologue, RMSNorm, silu_and_mul
from radixmesh.engine.quant.base import LinearMethod
from radixmesh.engine.quant.fp8 import Fp8LinearMethod


class RecordingMethod(LinearMethod):
    """Runs `apply_after` as a fused step would (the prologue's result, then the product) when `fuse` is set."""

    name = "recording"

    def __init__(self, fuse: bool) -> None:
        self.fuse = fuse
        self.calls: list[str] = []

    def prepare(self, model: nn.Module) -> int:
        return 0

    def adapt_weights(self, model: nn.Module,
                      weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(weights)

    def fill_dummy(self, model: nn.Module, seed: int) -> None:
        pass

    def apply(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("apply")
        return x @ layer.weight.t()

    def apply_after(self, layer: nn.Linear, x: torch.Tensor, prologue: Prologue) -> torch.Tensor | None:
        if not self.fuse:
            return None
        self.calls.append("apply_after")
        return prologue.apply(x) @ layer.weight.t()


def _layer(method: LinearMethod, n: int, k: int) -> Linear:
    layer = Linear(k, n, bias=False)
    layer.weight.data = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    layer.quant_method = method
    return layer


def test_the_method_runs_the_prologue_where_it_can_else_the_layer_does() -> None:
    x, residual = torch.randn(5, 16), torch.randn(5, 16)
    norm = RMSNorm(16, 1e-6)
    want = norm(x + residual) @ _layer(RecordingMethod(False), 8, 16).weight.t()
    for fuse in (True, False):
        method = RecordingMethod(fuse)
        prologue = AddRMSNorm(norm, residual)
        got = _layer(method, 8, 16)(x, prologue)
        torch.testing.assert_close(got, want)
        assert prologue.summed is not None and torch.equal(prologue.summed, x + residual)
        assert method.calls == (["apply_after"] if fuse else ["apply"])


def test_the_mlp_hands_silu_and_mul_to_the_down_projection() -> None:
    mlp = GatedMLP(16, 24)
    mlp.gate_up_proj.weight.data.normal_(generator=torch.Generator().manual_seed(1))
    mlp.down_proj.weight.data.normal_(generator=torch.Generator().manual_seed(2))
    method = RecordingMethod(True)
    mlp.down_proj.quant_method = method
    x = torch.randn(3, 16)
    torch.testing.assert_close(mlp(x), silu_and_mul(x @ mlp.gate_up_proj.weight.t()) @ mlp.down_proj.weight.t())
    assert method.calls == ["apply_after"]


def test_off_cuda_nothing_is_quantized_inside_a_prologue() -> None:
    x = torch.randn(4, 32)
    assert SILU_AND_MUL.quantized(x, torch.float8_e4m3fn) is None
    assert AddRMSNorm(RMSNorm(32, 1e-6), torch.zeros(4, 32)).quantized(x, torch.float8_e4m3fn) is None
    fp8 = Fp8LinearMethod(torch.device("cpu"), torch.float32)
    assert fp8.fuse_quant and fp8.apply_after(nn.Linear(32, 8), x, SILU_AND_MUL) is None
    assert not Fp8LinearMethod(torch.device("cpu"), torch.float32, fuse_quant=False).fuse_quant
