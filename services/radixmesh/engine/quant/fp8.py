"""FP8 linear layers (`--quantization fp8`, and FP8 checkpoints): e4m3 weights with one float32 scale per
output channel; activations quantized per token at run time (W8A8).

Which layers: every projection of the decoder layers (q/k/v, o, gate/up, down), less those a checkpoint
leaves unquantized. The embedding and the LM head stay in the model's dtype (as published FP8
checkpoints keep them; a tied LM head is the embedding).

Forward on CUDA: a one-row input (batch-1 decode) with `use_gemv` goes to the FP8-weight GEMV (bf16
activations, FP8 weights and scales read in its loop); otherwise the activations are quantized per
token (`kernels.fp8_quant`) and the GEMM runs through `torch._scaled_mm` or the Triton FP8 GEMM,
whichever `Fp8GemmPlan` measured faster for the shape. Where the input comes from an RMSNorm (q/k/v,
gate/up) or SiLU-and-mul (down), that kernel quantizes its own output (`kernels.fp8_fused`, `apply_after`):
one launch less per projection and the activations written once, in FP8; `fuse_quant=False`
(`--disable-fp8-quant-fusion`) quantizes in a launch of its own everywhere. On the CPU the same W8A8
arithmetic runs in float32 (`kernels.fp8_ref.fp8_linear_reference`): FP8 storage, GPU numerics, no speed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from radixmesh.common.errors import unsupported
from radixmesh.engine.models.layers import Linear, Prologue
from radixmesh.engine.quant.base import LinearMethod
from radixmesh.engine.quant.checkpoint import CheckpointQuant
from radixmesh.engine.quant.gemm_plan import Fp8GemmPlan
from radixmesh.engine.quant.weights import WEIGHT_DTYPE, Fp8WeightAdapter, checkpoint_modules
from radixmesh.kernels.fp8_ref import fp8_linear_reference, quantize_rows

DUMMY_STD = 0.02
"""Standard deviation of random weights (as `init_dummy_`), quantized like a checkpoint's."""

logger = logging.getLogger(__name__)


class Fp8LinearMethod(LinearMethod):
    name = "fp8"

    def __init__(self, device: torch.device, dtype: torch.dtype, checkpoint: CheckpointQuant | None = None,
                 gemm_backend: str = "auto", fuse_quant: bool = True) -> None:
        self.device, self.dtype, self.checkpoint = device, dtype, checkpoint
        self.fuse_quant = fuse_quant
        self.gemm = Fp8GemmPlan(gemm_backend, device, dtype) if device.type == "cuda" else None
        self.layers: dict[str, Linear] = {}
        self.expert_layers: dict[str, Any] = {}
        """MoE expert stacks (`models.moe.FusedExperts`) with FP8 storage."""
        self.adapter: Fp8WeightAdapter | None = None

    # ---- build -------------------------------------------------------------------------------
    def prepare(self, model: nn.Module) -> int:
        for name, module in model.named_modules():
            if isinstance(module, Linear) and ".layers." in f".{name}" and not self._kept(name):
                n, k = module.weight.shape
                module.weight = nn.Parameter(torch.empty(n, k, dtype=WEIGHT_DTYPE, device=module.weight.device),
                                             requires_grad=False)
                module.weight_scale = nn.Parameter(torch.empty(n, dtype=torch.float32, device=module.weight.device),
                                                   requires_grad=False)
                module.quant_method = self
                self.layers[name] = module
            elif (quantize_storage := getattr(module, "quantize_storage", None)) is not None and not self._kept(name):
                quantize_storage(WEIGHT_DTYPE)  # MoE experts: the MoE kernels read FP8 with row scales
                self.expert_layers[name] = module
        return len(self.layers) + len(self.expert_layers)

    def _kept(self, module: str) -> bool:
        """Whether the checkpoint stores this module unquantized (all of a stacked module's sources, or none)."""
        if self.checkpoint is None:
            return False
        ignored = [self.checkpoint.is_ignored(src) for src in checkpoint_modules(module)]
        if any(ignored) and not all(ignored):
            raise unsupported(f"the checkpoint quantizes only some of {checkpoint_modules(module)}, which this "
                              f"model runs as one layer", "quantization")
        return all(ignored)

    def adapt_weights(self, model: nn.Module,
                      weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        self.adapter = Fp8WeightAdapter(dict(model.named_parameters()), self.device)
        return self.adapter(weights)

    @torch.no_grad()
    def fill_dummy(self, model: nn.Module, seed: int) -> None:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        for layer in self.layers.values():
            w = torch.empty(layer.weight.shape, dtype=self.dtype, device=self.device).normal_(0.0, DUMMY_STD,
                                                                                              generator=gen)
            q, scale = quantize_rows(w, WEIGHT_DTYPE)
            layer.weight.copy_(q)
            _scale_of(layer).copy_(scale)
        for experts in self.expert_layers.values():
            experts.fill_dummy_fp8(gen, DUMMY_STD, self.dtype)

    def finish(self, model: nn.Module) -> None:
        if self.adapter is not None and self.adapter.num_input_scales:
            logger.info("FP8 checkpoint: %d static input scales not used (activations get dynamic per-token "
                        "scales)", self.adapter.num_input_scales)
        if self.gemm is not None:
            self.gemm.plan((int(layer.weight.shape[0]), int(layer.weight.shape[1])) for layer in self.layers.values())
        logger.info("FP8 weights in %d linear layers and %d expert stacks (%s)", len(self.layers),
                    len(self.expert_layers),
                    self.checkpoint.source_format + " checkpoint" if self.checkpoint else "quantized at load")

    def kv_scales(self) -> dict[int, dict[str, float]]:
        """FP8 KV-cache scales the checkpoint carried, per layer ({} when none)."""
        return self.adapter.kv_scales if self.adapter is not None else {}

    def describe(self) -> dict[str, object]:
        source = self.checkpoint.source_format if self.checkpoint else None
        info: dict[str, object] = {"quantization": self.name, "fp8_linear_layers": len(self.layers),
                                   "fp8_expert_layers": len(self.expert_layers), "checkpoint_quantization": source}
        if self.gemm is not None:
            info["fp8_gemm_kernels"] = {f"{n}x{k}": row for (n, k), row in self.gemm.table.items()}
            info["fp8_gemm_timings_us"] = self.gemm.timings
        return info

    # ---- forward -----------------------------------------------------------------------------
    def gemv_weights(self, layer: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return (layer.weight, _scale_of(layer)) if self.gemm is not None else None

    def apply(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        weight, scale = layer.weight, _scale_of(layer)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.gemm is None or not x.is_cuda:
            y = fp8_linear_reference(x2, weight, scale, layer.bias)
            return y.reshape(*shape[:-1], -1)
        if x2.shape[0] == 1 and getattr(layer, "use_gemv", False) and x2.is_contiguous():
            from radixmesh.kernels.gemv import gemv_fp8

            y = gemv_fp8(x2, weight, scale)
        else:
            from radixmesh.kernels.fp8_quant import quantize_rows as quantize_tokens

            xq, xs = quantize_tokens(x2, weight.dtype)
            y = self.gemm(xq, xs, weight, scale)
        if layer.bias is not None:
            y = y.add_(layer.bias)
        return y.reshape(*shape[:-1], -1)

    def apply_after(self, layer: nn.Linear, x: torch.Tensor, prologue: Prologue) -> torch.Tensor | None:
        if not self.fuse_quant or self.gemm is None or not x.is_cuda or x.dim() != 2:
            return None
        if x.shape[0] == 1 and getattr(layer, "use_gemv", False):
            return None  # the batch-1 GEMV reads bf16 activations
        quantized = prologue.quantized(x, layer.weight.dtype)
        if quantized is None:
            return None
        y = self.gemm(*quantized, layer.weight, _scale_of(layer))
        return y if layer.bias is None else y.add_(layer.bias)


def _scale_of(layer: nn.Module) -> torch.Tensor:
    """The FP8 row scales `[N]` float32 that `prepare` registered on `layer`."""
    scale = layer.weight_scale
    assert isinstance(scale, torch.Tensor), f"{type(layer).__name__} has no FP8 weight scales"
    return scale
