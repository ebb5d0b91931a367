"""What a checkpoint's `quantization_config` (config.json) says, for the formats we load.

Loaded as published, into per-output-channel FP8 storage (`fp8` linear method):

- Hugging Face `quant_method: fp8` (AutoFP8, llm-compressor's HF export): FP8 e4m3 weights with a
  `weight_scale` per tensor or per output channel, `input_scale` when activations are static;
- `quant_method: fbgemm_fp8` (e.g. Meta's FP8 Llama 3.1): per-channel `weight_scale`, dynamic activations;
- `quant_method: compressed-tensors` with float8 weights (`type: float`, `num_bits: 8`) of strategy
  `tensor` or `channel`, activations dynamic per token, static per tensor, or none (weight-only).

Activations always run with dynamic per-token scales (a static checkpoint's `input_scale`s are read and
not used: per-token scales are at least as accurate). Block-wise scales (`weight_block_size`, strategy
`block`/`group`), integer schemes and other methods are refused with an error naming what was found.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from radixmesh.common.errors import unsupported

SUPPORTED = "fp8 and fbgemm_fp8 (per-tensor or per-channel scales), compressed-tensors float8 (tensor or channel)"


@dataclass(frozen=True)
class CheckpointQuant:
    """How a pre-quantized checkpoint stores its linear layers."""

    method: str
    """Linear method id it runs with (see quant/registry.py): fp8."""
    source_format: str
    """quant_method of the checkpoint: fp8 | fbgemm_fp8 | compressed-tensors."""
    activation_scheme: str
    """dynamic | static | none (weight-only) as published; the engine runs dynamic per-token scales."""
    ignore: tuple[str, ...] = ()
    """Modules left unquantized: names, name prefixes, or `re:` patterns (compressed-tensors)."""

    def is_ignored(self, module: str) -> bool:
        """Whether checkpoint module `module` (e.g. model.layers.0.mlp.down_proj) is stored unquantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], module):
                    return True
            elif module == entry or module.startswith(entry + ".") or module.endswith("." + entry):
                return True
        return False


def parse_quantization_config(cfg: dict[str, Any] | None) -> CheckpointQuant | None:
    """The checkpoint's quantization, or None for an unquantized checkpoint; unsupported ones raise."""
    if not cfg:
        return None
    method = str(cfg.get("quant_method", "")).lower().replace("_", "-")
    if method == "fp8":
        _no_blocks(cfg.get("weight_block_size"))
        scheme = str(cfg.get("activation_scheme", "dynamic"))
        return CheckpointQuant("fp8", "fp8", scheme, _names(cfg, "modules_to_not_convert", "ignored_layers"))
    if method == "fbgemm-fp8":
        return CheckpointQuant("fp8", "fbgemm_fp8", "dynamic", _names(cfg, "modules_to_not_convert"))
    if method == "compressed-tensors":
        return _compressed_tensors(cfg)
    raise unsupported(f"the checkpoint's quantization {cfg.get('quant_method')!r} is not supported "
                      f"(supported: {SUPPORTED})", "quantization")


def _names(cfg: dict[str, Any], *keys: str) -> tuple[str, ...]:
    return tuple(str(name) for key in keys for name in (cfg.get(key) or ()))


def _no_blocks(block_size: Any) -> None:
    if block_size:
        raise unsupported(f"FP8 checkpoints with block-wise scales (weight_block_size {list(block_size)}) are not "
                          f"supported; per-tensor and per-channel scales are", "quantization")


def _compressed_tensors(cfg: dict[str, Any]) -> CheckpointQuant:
    fmt = str(cfg.get("format", "float-quantized"))
    if fmt not in ("float-quantized", "naive-quantized"):
        raise unsupported(f"compressed-tensors format {fmt!r} is not supported (float-quantized FP8 is)",
                          "quantization")
    groups = cfg.get("config_groups") or {}
    if not groups:
        raise unsupported("compressed-tensors checkpoint without config_groups", "quantization")
    schemes = {_activation_scheme(name, group) for name, group in groups.items()}
    if len(schemes) > 1:
        raise unsupported(f"compressed-tensors groups with different activation schemes {sorted(schemes)} are not "
                          f"supported", "quantization")
    return CheckpointQuant("fp8", "compressed-tensors", schemes.pop(), _names(cfg, "ignore"))


def _activation_scheme(name: str, group: dict[str, Any]) -> str:
    """Checks one config group's weights (float8, tensor or channel) and returns its activation scheme."""
    weights = group.get("weights") or {}
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy", "tensor")
    if kind != "float" or bits != 8:
        raise unsupported(f"compressed-tensors group {name!r} has {kind} {bits}-bit weights; only float8 weights "
                          f"are supported", "quantization")
    if strategy not in ("tensor", "channel"):
        raise unsupported(f"compressed-tensors group {name!r} has weight strategy {strategy!r}; only 'tensor' and "
                          f"'channel' are supported (no block or group scales)", "quantization")
    acts = group.get("input_activations")
    if not acts:
        return "none"
    if acts.get("type") != "float" or acts.get("num_bits") != 8:
        raise unsupported(f"compressed-tensors group {name!r} quantizes activations to {acts.get('type')} "
                          f"{acts.get('num_bits')}-bit; only float8 is supported", "quantization")
    return "dynamic" if acts.get("dynamic") else "static"
