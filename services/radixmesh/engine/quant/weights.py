"""Checkpoint tensors -> the parameters of FP8 linear layers (per-output-channel storage).

Each quantized layer holds `weight` `[N, K]` FP8 e4m3 and `weight_scale` `[N]` float32. From the
checkpoint's stream of `(name, tensor)`:

- a float weight of a quantized layer is quantized here, per output row (on the model's device);
  per-row scales make that exact shard by shard, so q/k/v and gate/up load into their stacked rows;
- an FP8 weight is paired with its `weight_scale` (or `weight_scale_inv`) whichever comes first; a
  per-tensor scale is repeated for every row of its shard, so the published FP8 values are kept;
- an FP8 weight of a layer the model keeps unquantized is dequantized to the model's dtype;
- `input_scale`s are dropped (activations use dynamic per-token scales); FP8 KV scales
  (`self_attn.k_scale`/`v_scale`, `k_proj.output_scale`, `kv_scale`) are kept for the KV pool.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from radixmesh.common.errors import invalid_argument, unsupported
from radixmesh.engine.models.llama import STACKED_PARAMS
from radixmesh.kernels.fp8_ref import quantize_rows

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
WEIGHT_DTYPE = torch.float8_e4m3fn
"""FP8 format of quantized weights (e4m3: the precision weights need; e5m2 trades it for range)."""
_SCALE_LEAVES = ("weight_scale", "weight_scale_inv")
_KV_SCALE = re.compile(r".*\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.output_scale|"
                       r"v_proj\.output_scale)$")


def target_param(name: str) -> str:
    """The model parameter a checkpoint tensor loads into (q/k/v -> qkv_proj, gate/up -> gate_up_proj)."""
    module_path, _, leaf = name.rpartition(".")
    parent, _, module = module_path.rpartition(".")
    if module in STACKED_PARAMS:
        return f"{parent}.{STACKED_PARAMS[module][0]}.{leaf}"
    return name


def checkpoint_modules(module: str) -> list[str]:
    """The checkpoint modules a model module loads from: `...qkv_proj` -> its q, k and v projections."""
    parent, _, leaf = module.rpartition(".")
    sources = sorted((shard, name) for name, (stacked, shard) in STACKED_PARAMS.items() if stacked == leaf)
    return [f"{parent}.{name}" for _, name in sources] or [module]


class Fp8WeightAdapter:
    """One pass over a checkpoint stream (see the module docstring); collects the KV scales it meets."""

    def __init__(self, params: dict[str, torch.Tensor], device: torch.device) -> None:
        self.params = params
        self.device = device
        self.kv_scales: dict[int, dict[str, float]] = {}
        """layer -> {"k": scale, "v": scale} found in the checkpoint."""
        self.num_input_scales = 0
        self.num_quantized_here = 0

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        pending_w: dict[str, torch.Tensor] = {}
        pending_s: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            prefix, _, leaf = name.rpartition(".")
            if leaf == "input_scale":
                self.num_input_scales += 1
                continue
            if self._take_kv_scale(name, tensor):
                continue
            if leaf in _SCALE_LEAVES:
                pending_s[prefix] = tensor
            elif leaf == "weight" and tensor.dtype in FP8_DTYPES:
                pending_w[prefix] = tensor
            elif leaf == "weight" and self._is_fp8(prefix):
                yield from self._quantize(prefix, tensor)
                continue
            else:
                yield name, tensor
                continue
            if prefix in pending_w and prefix in pending_s:
                yield from self._prequantized(prefix, pending_w.pop(prefix), pending_s.pop(prefix))
        if pending_w or pending_s:
            alone = sorted(pending_w) or sorted(pending_s)
            what = "FP8 weights without a weight_scale" if pending_w else "weight_scale without an FP8 weight"
            raise invalid_argument(f"checkpoint has {what}: {alone[0]!r} ({len(alone)} in all)")

    def _is_fp8(self, prefix: str) -> bool:
        param = self.params.get(target_param(f"{prefix}.weight"))
        return param is not None and param.dtype in FP8_DTYPES

    def _quantize(self, prefix: str, weight: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        q, scale = quantize_rows(weight.to(self.device), WEIGHT_DTYPE)
        self.num_quantized_here += 1
        yield f"{prefix}.weight", q
        yield f"{prefix}.weight_scale", scale

    def _prequantized(self, prefix: str, weight: torch.Tensor,
                      scale: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        rows = weight.shape[0]
        flat = scale.float().reshape(-1)
        if flat.numel() == 1:
            flat = flat.expand(rows)  # per-tensor: the same scale for every row of this shard
        elif flat.numel() != rows:
            raise unsupported(f"{prefix}.weight_scale has shape {tuple(scale.shape)} for a weight of "
                              f"{tuple(weight.shape)}: only per-tensor and per-channel scales are supported "
                              f"(not block-wise)", "quantization")
        if not self._is_fp8(prefix):  # a layer kept in the model's dtype: dequantize
            param = self.params.get(target_param(f"{prefix}.weight"))
            dtype = param.dtype if param is not None else torch.float32
            yield f"{prefix}.weight", (weight.to(self.device).float() * flat.to(self.device)[:, None]).to(dtype)
            return
        if weight.dtype != WEIGHT_DTYPE:
            raise unsupported(f"{prefix}.weight is {weight.dtype}; FP8 weights load as {WEIGHT_DTYPE}",
                              "quantization")
        yield f"{prefix}.weight", weight
        yield f"{prefix}.weight_scale", flat

    def _take_kv_scale(self, name: str, tensor: torch.Tensor) -> bool:
        match = _KV_SCALE.match(name)
        if match is None:
            return False
        layer, kind = int(match.group(1)), match.group(2)
        value = float(tensor.float().reshape(-1).max())
        entry = self.kv_scales.setdefault(layer, {})
        for key in ("k", "v") if kind == "kv_scale" else (kind[0],):
            entry[key] = value
        return True
