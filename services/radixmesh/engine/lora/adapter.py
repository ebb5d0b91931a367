"""A PEFT LoRA adapter in host memory: read from `adapter_config.json` + `adapter_model.safetensors`, checked
against the base model.

PEFT names a layer's matrices `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`:
A is `[rank, in]`, B `[out, rank]`, and the layer's output gains `scaling * x @ A.T @ B.T` with `scaling =
lora_alpha / rank` (`lora_alpha / sqrt(rank)` with `use_rslora`). Bad adapters (another base model's shapes,
a rank above `--max-lora-rank`, targets this engine does not serve) raise INVALID_ARGUMENT naming the mismatch.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.model_config import ModelConfig
from radixmesh.wire.lora import TARGET_MODULES

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights (CPU, as stored) and scaling, checked against a base model."""

    name: str
    """The name requests use (`model: "base:NAME"`, `lora_path`)."""
    path: str
    """The directory it was read from."""
    rank: int
    """LoRA rank r."""
    scaling: float
    """lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
    targets: tuple[str, ...]
    """Target projections, in TARGET_MODULES order."""
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    """(layer, module) -> (A [r, in], B [out, r])."""
    base_model: str | None = None
    """`base_model_name_or_path` of its config, when given."""

    @property
    def num_bytes(self) -> int:
        """Host bytes of its matrices."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection of the whole (unsharded) model."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def read_adapter_config(path: str, name: str) -> dict[str, object]:
    """The adapter's `adapter_config.json` (INVALID_ARGUMENT when it is missing or not a LoRA adapter)."""
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise invalid_argument(f"LoRA adapter {name!r}: no adapter_config.json in {path!r}", "lora_path")
    with open(file, encoding="utf-8") as f:
        cfg: dict[str, object] = json.load(f)
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise invalid_argument(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not LORA", "lora_path")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise invalid_argument(f"LoRA adapter {name!r}: per-module ranks or alphas ({key}) are not supported",
                                   "lora_path")
    if cfg.get("use_dora"):
        raise invalid_argument(f"LoRA adapter {name!r}: DoRA adapters are not supported", "lora_path")
    return cfg


def load_adapter(name: str, path: str, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check the adapter at `path` for a base model of `config`."""
    cfg = read_adapter_config(path, name)
    rank = int(cfg.get("r", 8))  # type: ignore[call-overload]
    if not 1 <= rank <= max_rank:
        raise invalid_argument(f"LoRA adapter {name!r} has rank {rank}; this server serves ranks up to "
                               f"--max-lora-rank {max_rank}", "lora_path")
    alpha = float(cfg.get("lora_alpha", rank))  # type: ignore[arg-type]
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    weights = _read_weights(name, path, config, rank)
    targets = tuple(m for m in TARGET_MODULES if any(module == m for _, module in weights))
    base = cfg.get("base_model_name_or_path")
    return LoraAdapter(name, path, rank, scaling, targets, weights, str(base) if base else None)


def _read_weights(name: str, path: str, config: ModelConfig,
                  rank: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors.torch import load_file

    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise invalid_argument(f"LoRA adapter {name!r}: no adapter_model.safetensors in {path!r}", "lora_path")
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    for key, tensor in load_file(file).items():
        match = _KEY.search(key)
        if match is None:
            raise invalid_argument(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA matrix of a target "
                                   f"projection ({', '.join(TARGET_MODULES)})", "lora_path")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if module not in TARGET_MODULES:
            raise invalid_argument(f"LoRA adapter {name!r} targets {module!r}; served targets are "
                                   f"{', '.join(TARGET_MODULES)}", "lora_path")
        halves[(layer, module, half)] = tensor  # as stored: a slot write converts it to the model's dtype
    shapes = module_shapes(config)
    weights = {}
    for (layer, module, half), a in halves.items():
        if half != "A":
            continue
        b = halves.get((layer, module, "B"))
        if b is None:
            raise invalid_argument(f"LoRA adapter {name!r}: layer {layer} {module} has lora_A but no lora_B",
                                   "lora_path")
        _check_shapes(name, config, layer, module, a, b, rank, shapes[module])
        weights[(layer, module)] = (a.contiguous(), b.contiguous())
    if not weights:
        raise invalid_argument(f"LoRA adapter {name!r}: no LoRA matrices in {file!r}", "lora_path")
    return weights


def _check_shapes(name: str, config: ModelConfig, layer: int, module: str, a: torch.Tensor, b: torch.Tensor,
                  rank: int, in_out: tuple[int, int]) -> None:
    """INVALID_ARGUMENT naming the mismatch with the base model (another model's adapter)."""
    if layer >= config.num_layers:
        raise invalid_argument(f"LoRA adapter {name!r} has layer {layer}; the base model has {config.num_layers} "
                               "layers (an adapter of another base model?)", "lora_path")
    want_in, want_out = in_out
    if tuple(a.shape) != (rank, want_in) or tuple(b.shape) != (want_out, rank):
        raise invalid_argument(
            f"LoRA adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; the base "
            f"model needs A ({rank}, {want_in}) and B ({want_out}, {rank}) (an adapter of another base model?)",
            "lora_path")
