"""The contract of a quantization method for linear layers (`--quantization`, checkpoint formats).

The model is built on the meta device; the method then owns the layers it quantizes through four
steps, in this order:

1. `prepare(model)` (meta device): give each quantized `Linear` its storage (e.g. FP8 weights and a
   float32 scale per output channel) and set `layer.quant_method = self`;
2. `adapt_weights(model, weights)`: turn the checkpoint's `(name, tensor)` stream into tensors shaped
   and typed like the prepared parameters (quantizing float weights, expanding scales), so the
   model's `load_weights` copies them by name; or `fill_dummy(model, seed)` for random weights;
3. `finish(model)`: after the weights are in place (pick kernels, warm them up);
4. `apply(layer, x)`: the layer's forward, `x` `[tokens, in]` -> `[tokens, out]` in `x`'s dtype
   (`apply_after(layer, x, prologue)`: of `prologue(x)`, where the method runs the prologue inside its
   own input step). Neither may sync with the host (CUDA graphs capture them).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from radixmesh.engine.models.layers import Prologue


class LinearMethod(abc.ABC):
    """Storage and forward of the quantized linear layers of one model."""

    name: str = ""
    """Registry id (kebab-case), e.g. fp8."""

    @abc.abstractmethod
    def prepare(self, model: nn.Module) -> int:
        """Quantize the storage of the model's eligible `Linear` layers (meta device); how many."""

    @abc.abstractmethod
    def adapt_weights(self, model: nn.Module,
                      weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors as the prepared parameters take them."""

    @abc.abstractmethod
    def fill_dummy(self, model: nn.Module, seed: int) -> None:
        """Random weights for the quantized layers (the rest is filled by `init_dummy_`)."""

    def finish(self, model: nn.Module) -> None:  # noqa: B027 (optional step)
        """Called once the weights are loaded, before the model runs (and before CUDA-graph capture)."""

    @abc.abstractmethod
    def apply(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for `x` `[tokens, in_features]`."""

    def apply_after(self, layer: nn.Linear, x: torch.Tensor, prologue: Prologue) -> torch.Tensor | None:
        """The layer's output for `prologue(x)` with the prologue inside the method's own input step (FP8: the
        norm or SiLU-and-mul kernel quantizes the activations itself); None: the caller applies the prologue,
        then `apply`."""
        return None

    def gemv_weights(self, layer: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight, row scales) a batch-1 GEMV kernel reads for this layer (`radixmesh.kernels.gemv_fused`);
        None: one-row calls go through `apply` alone."""
        return None

    def kv_scales(self) -> dict[int, dict[str, float]]:
        """FP8 KV-cache scales the checkpoint carried, per layer ({} when none)."""
        return {}

    def describe(self) -> dict[str, object]:
        """What /server_info and logs show about the method (kernels chosen, formats)."""
        return {"quantization": self.name}
