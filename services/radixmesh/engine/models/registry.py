"""Model family id -> model class, imported lazily."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from torch import nn

from radixmesh.common.errors import unsupported
from radixmesh.engine.model_config import ModelConfig

_MODELS: dict[str, str] = {
    "llama": "radixmesh.engine.models.llama:CausalLM",
    "qwen2": "radixmesh.engine.models.llama:CausalLM",
    "qwen3": "radixmesh.engine.models.llama:CausalLM",
    "llava": "radixmesh.engine.models.llava:LlavaForConditionalGeneration",
    "qwen2_vl": "radixmesh.engine.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "radixmesh.engine.models.qwen2_vl:Qwen2VLForConditionalGeneration",
}


class LoadsWeights(Protocol):
    """What every model class has besides nn.Module's methods."""

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy checkpoint tensors (or lazy slices of them under TP), by checkpoint name, into the parameters."""


def model_class(config: ModelConfig) -> Callable[..., nn.Module]:
    """The model class of `config`'s family: `cls(config)`, or `cls(config, tp)` for one tensor-parallel rank."""
    target = _MODELS.get(config.family)
    if target is None:
        raise unsupported(f"no model implementation for family {config.family!r}")
    module, _, attr = target.partition(":")
    cls: Callable[..., nn.Module] = getattr(importlib.import_module(module), attr)
    return cls
