"""Model families (engine/models/registry.py): each family's facts, declared once, read by the config parser, the
GGUF converter, the dummy configs and the model runner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.loader.dummy import NAMED_SHAPES, named_shape_config
from radixmesh.engine.loader.gguf_convert import _architecture, _hf_architecture, _rope_permuted
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.registry import (
    FAMILIES,
    MODEL_CLASSES,
    SUPPORTED_ARCHITECTURES,
    family_of,
    gguf_family,
    model_class,
    model_family,
    model_type_of,
)
from radixmesh.engine.runner_build import check_tp_combination

HF: dict[str, Any] = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "num_key_value_heads": 2}


def test_every_family_names_a_class_and_at_least_one_architecture() -> None:
    ids = [f.id for f in FAMILIES]
    assert len(ids) == len(set(ids)) and set(ids) == set(MODEL_CLASSES)
    for family in FAMILIES:
        assert family.architectures and ":" in family.model and MODEL_CLASSES[family.id] == family.model
        assert model_family(family.id) is family
        for arch in family.architectures:
            assert family_of(arch) is family
    assert len(SUPPORTED_ARCHITECTURES) == sum(len(f.architectures) for f in FAMILIES)  # no architecture twice


def test_the_facts_of_the_families_served_today() -> None:
    tp = {f.id for f in FAMILIES if f.tensor_parallel}
    images = {f.id for f in FAMILIES if f.multimodal}
    assert tp == {"llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"} and images == {"llava", "qwen2_vl", "qwen2_5_vl"}
    assert family_of("MistralForCausalLM") is model_family("llama")
    assert {f.id for f in FAMILIES if f.qkv_bias} == {"qwen2", "qwen2_vl", "qwen2_5_vl"}
    assert [f.id for f in FAMILIES if f.qk_norm] == ["qwen3", "qwen3_moe"]
    assert {f.gguf_architecture: f.id for f in FAMILIES if f.gguf_architecture} == {
        "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
    assert [f.id for f in FAMILIES if f.gguf_rope_permuted] == ["llama"]
    assert {f.id: f.moe for f in FAMILIES if f.moe} == {"qwen3_moe": "qwen3-moe", "mixtral": "mixtral"}


def test_unknown_families_and_architectures() -> None:
    with pytest.raises(RadixMeshError) as info:
        model_family("gpt9")
    assert info.value.code is ErrorCode.UNSUPPORTED and "gpt9" in info.value.message
    assert family_of("GPT9ForCausalLM") is None and gguf_family("gpt9") is None
    with pytest.raises(RadixMeshError):
        model_type_of("GPT9ForCausalLM")
    with pytest.raises(RadixMeshError, match="unsupported architecture 'GPT9ForCausalLM'"):
        ModelConfig.from_hf_dict({**HF, "architectures": ["GPT9ForCausalLM"]})


@pytest.mark.parametrize(("arch", "bias", "qk_norm", "family"), [
    ("LlamaForCausalLM", False, False, "llama"), ("MistralForCausalLM", False, False, "llama"),
    ("Qwen2ForCausalLM", True, False, "qwen2"), ("Qwen3ForCausalLM", False, True, "qwen3"),
    ("Qwen3MoeForCausalLM", False, True, "qwen3_moe"), ("MixtralForCausalLM", False, False, "mixtral")])
def test_the_config_parser_reads_the_family_facts(arch: str, bias: bool, qk_norm: bool, family: str) -> None:
    config = ModelConfig.from_hf_dict({**HF, "architectures": [arch]})
    assert (config.attention_bias, config.qk_norm, config.family, config.is_multimodal) == (bias, qk_norm, family,
                                                                                            False)
    assert config.model_family is model_family(family)
    explicit = ModelConfig.from_hf_dict({**HF, "architectures": [arch], "attention_bias": not bias})
    assert explicit.attention_bias is (not bias)  # config.json wins over the family's default


def test_a_multimodal_config_takes_its_language_fields_from_its_text_config() -> None:
    config = ModelConfig.from_hf_dict({"architectures": ["LlavaForConditionalGeneration"], "text_config": HF})
    assert config.is_multimodal and config.family == "llava" and config.hidden_size == 16


@pytest.mark.parametrize("name", sorted(NAMED_SHAPES))
def test_every_named_shape_writes_its_familys_model_type(name: str) -> None:
    shape = NAMED_SHAPES[name]
    arch = shape["architectures"][0]
    assert shape["model_type"] == model_type_of(arch)
    assert named_shape_config(name).architecture == arch


def test_gguf_architectures_convert_to_their_familys_first_architecture() -> None:
    assert _hf_architecture("llama") == "LlamaForCausalLM" and _hf_architecture("qwen3") == "Qwen3ForCausalLM"
    assert _rope_permuted("llama") and not _rope_permuted("qwen2") and not _rope_permuted("gpt9")

    class Reader:
        def __init__(self, arch: str | None) -> None:
            self.fields = {} if arch is None else {"general.architecture": self}
            self.arch = arch

        def contents(self) -> str | None:
            return self.arch

    assert _architecture(Reader("qwen2"), Path("m.gguf")) == "qwen2"
    for bad in ("mamba", None):
        with pytest.raises(RadixMeshError) as info:
            _architecture(Reader(bad), Path("m.gguf"))
        assert info.value.code is ErrorCode.UNSUPPORTED and "supported: llama, qwen2, qwen3" in info.value.message


def test_tensor_parallelism_follows_the_family_fact() -> None:
    for family in FAMILIES:
        if family.tensor_parallel:
            check_tp_combination(family.id, 2, False, False)
        else:
            with pytest.raises(RadixMeshError, match=repr(family.id)):
                check_tp_combination(family.id, 2, False, False)


def test_the_class_is_imported_only_when_asked() -> None:
    import torch.nn as nn

    cls = model_class("llama")
    assert isinstance(cls, type) and issubclass(cls, nn.Module) and model_class("qwen3") is cls  # llama.py: qwen too
    with pytest.raises(RadixMeshError):
        model_class("gpt9")


def test_a_model_directory_of_each_text_family_loads_its_config(tmp_path: Path) -> None:
    for family in FAMILIES:
        if family.multimodal:
            continue
        for arch, model_type in family.architectures.items():
            root = tmp_path / arch
            root.mkdir()
            (root / "config.json").write_text(json.dumps({**HF, "architectures": [arch], "model_type": model_type}))
            assert ModelConfig.from_dir(root).family == family.id
