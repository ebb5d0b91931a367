"""Model families: what the engine knows of each model, declared once, and its class, imported lazily.

A family declares its facts here, beside the name of its class: the Hugging Face architectures it serves
(with the `model_type` a generated config.json gets), whether its layers shard across tensor-parallel ranks,
whether it takes images, its q/k/v biases and q/k norms, how config.json describes its experts (MoE), and the
GGUF architecture llama.cpp files it under.
The config parser, the GGUF converter, the dummy-weight configs and the model runner all read these facts,
and none of them imports torch to do so (the front-end processes never do). A new model is two files: its
module under engine/models/ (the class, with `load_weights`) and one `ModelFamily` entry below.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from radixmesh.common.errors import unsupported
from radixmesh.common.registry import LazyRegistry

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its class and the facts the engine reads without importing it."""

    id: str
    """Family id (`ModelConfig.family`)."""
    model: str
    """"module:Class" of its implementation: `cls(config)`, or `cls(config, tp)` for one tensor-parallel rank."""
    architectures: dict[str, str]
    """Hugging Face `architectures[0]` values it serves -> the config.json `model_type` of each."""
    tensor_parallel: bool = False
    """Its layers shard across tensor-parallel ranks (--tp-size > 1)."""
    multimodal: bool = False
    """It takes images (a vision encoder before the language model; see radixmesh.engine.mm)."""
    qkv_bias: bool = False
    """q/k/v projections have biases unless config.json says otherwise."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before rotary."""
    gguf_architecture: str | None = None
    """GGUF `general.architecture` of its files (the first of `architectures` is what they convert to)."""
    gguf_rope_permuted: bool = False
    """llama.cpp stored the q/k projections of its GGUF files rope-permuted (undone on conversion)."""
    draft_head: bool = False
    """A speculative draft head (EAGLE): it loads only as --speculative-draft-model of a target."""
    moe: str | None = None
    """Its MLPs are mixtures of experts, described in config.json the way of `qwen3-moe` or `mixtral`
    (models/moe_spec.py reads either); None: a dense model."""


class LoadsWeights(Protocol):
    """What every model class has besides nn.Module's methods.

    Optional, looked up by name: `configure_engine(engine_config)`, called once its weights are loaded (MoE
    models take their dispatch settings and the largest CUDA-graph batch), and `server_info() -> dict`, merged
    into what /server_info reports (MoE models: assignments per expert and per expert-parallel rank).
    """

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy checkpoint tensors (or lazy slices of them under TP), by checkpoint name, into the parameters."""


LLAMA_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}
FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("llama", "radixmesh.engine.models.llama:CausalLM", LLAMA_ARCHITECTURES, tensor_parallel=True,
                gguf_architecture="llama", gguf_rope_permuted=True),
    ModelFamily("qwen2", "radixmesh.engine.models.llama:CausalLM", {"Qwen2ForCausalLM": "qwen2"},
                tensor_parallel=True, qkv_bias=True, gguf_architecture="qwen2"),
    ModelFamily("qwen3", "radixmesh.engine.models.llama:CausalLM", {"Qwen3ForCausalLM": "qwen3"},
                tensor_parallel=True, qk_norm=True, gguf_architecture="qwen3"),
    ModelFamily("qwen3_moe", "radixmesh.engine.models.moe_decoder:MoeCausalLM", {"Qwen3MoeForCausalLM": "qwen3_moe"},
                tensor_parallel=True, qk_norm=True, gguf_architecture="qwen3moe", moe="qwen3-moe"),
    ModelFamily("mixtral", "radixmesh.engine.models.moe_decoder:MoeCausalLM", {"MixtralForCausalLM": "mixtral"},
                tensor_parallel=True, moe="mixtral"),  # GGUF: a llama file with experts (loader/gguf_experts.py)
    ModelFamily("llava", "radixmesh.engine.models.llava:LlavaForConditionalGeneration",
                {"LlavaForConditionalGeneration": "llava"}, multimodal=True),
    ModelFamily("qwen2_vl", "radixmesh.engine.models.qwen2_vl:Qwen2VLForConditionalGeneration",
                {"Qwen2VLForConditionalGeneration": "qwen2_vl"}, multimodal=True, qkv_bias=True),
    ModelFamily("qwen2_5_vl", "radixmesh.engine.models.qwen2_vl:Qwen2VLForConditionalGeneration",
                {"Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}, multimodal=True, qkv_bias=True),
    # speculative draft heads over a Llama target (--speculative-algorithm eagle / eagle3), never served alone
    ModelFamily("llama_eagle", "radixmesh.engine.models.eagle:EagleDraft", {"LlamaForCausalLMEagle": "llama"},
                draft_head=True),
    ModelFamily("llama_eagle3", "radixmesh.engine.models.eagle:Eagle3Draft", {"LlamaForCausalLMEagle3": "llama"},
                draft_head=True),
)
"""Every model family, in the order errors list them."""

_BY_ID = {family.id: family for family in FAMILIES}
_BY_ARCHITECTURE = {arch: family for family in FAMILIES for arch in family.architectures}
MODEL_CLASSES: LazyRegistry[Callable[..., nn.Module]] = LazyRegistry(
    "model family", {family.id: family.model for family in FAMILIES},
    error=lambda message, param: unsupported(message, param))
"""Family id -> its model class, imported on first use."""
SUPPORTED_ARCHITECTURES = tuple(_BY_ARCHITECTURE)
"""Hugging Face architectures some family serves."""


def model_family(family_id: str) -> ModelFamily:
    """The family `family_id`; UNSUPPORTED for an unknown one."""
    family = _BY_ID.get(family_id)
    if family is None:
        raise unsupported(f"no model implementation for family {family_id!r}")
    return family


def family_of(architecture: str) -> ModelFamily | None:
    """The family serving Hugging Face `architecture`, or None."""
    return _BY_ARCHITECTURE.get(architecture)


def gguf_family(gguf_architecture: str) -> ModelFamily | None:
    """The family whose GGUF files carry `general.architecture` = `gguf_architecture`, or None."""
    return next((f for f in FAMILIES if f.gguf_architecture == gguf_architecture), None)


def model_type_of(architecture: str) -> str:
    """The config.json `model_type` of a served Hugging Face architecture (dummy configs write it)."""
    family = family_of(architecture)
    if family is None:
        raise unsupported(f"unsupported architecture {architecture!r}")
    return family.architectures[architecture]


def model_class(family_id: str) -> Callable[..., nn.Module]:
    """The model class of family `family_id`: `cls(config)`, or `cls(config, tp)` for one tensor-parallel rank."""
    model_family(family_id)
    return MODEL_CLASSES.load(family_id)
