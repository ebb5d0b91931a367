"""Weight loaders without a real model: tiny safetensors directories and a tiny GGUF file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.loader import (
    LOAD_FORMATS,
    NAMED_SHAPES,
    init_dummy_,
    iter_weights,
    prepare_model,
    resolve_model_path,
)
from radixmesh.engine.loader.default_model import ensure_default_model
from radixmesh.engine.loader.dummy import named_shape_config
from radixmesh.engine.loader.safetensors_loader import iter_safetensors_weights
from radixmesh.engine.model_config import ModelConfig

from .loader_factory import (  # isolated_cache: an autouse fixture
    TINY,
    assert_one_line_error,
    assert_same,
    fake_default_model,
    isolated_cache,
    make_model_dir,
)

# --- safetensors -------------------------------------------------------------------------------

@pytest.mark.parametrize(("num_shards", "with_index"), [(1, True), (3, True), (2, False)])
def test_safetensors_single_and_sharded(tmp_path: Path, num_shards: int, with_index: bool) -> None:
    expected = make_model_dir(tmp_path / "m", num_shards=num_shards, with_index=with_index)
    assert_same(dict(iter_safetensors_weights(tmp_path / "m", progress=False)), expected)


def test_safetensors_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(RadixMeshError) as info:
        list(iter_safetensors_weights(tmp_path / "nope"))
    assert_one_line_error(info.value, ErrorCode.NOT_FOUND, "nope")


def test_safetensors_bin_only_dir_says_bin_is_unsupported(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(RadixMeshError) as info:
        list(iter_safetensors_weights(tmp_path))
    assert_one_line_error(info.value, ErrorCode.NOT_FOUND, "no safetensors", ".bin")


def test_safetensors_missing_shard(tmp_path: Path) -> None:
    make_model_dir(tmp_path, num_shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(RadixMeshError) as info:
        list(iter_safetensors_weights(tmp_path))
    assert_one_line_error(info.value, ErrorCode.NOT_FOUND, "model-00002-of-00002.safetensors")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_safetensors_corrupt_file(tmp_path: Path, damage: str) -> None:
    make_model_dir(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07not a safetensors file")
    with pytest.raises(RadixMeshError) as info:
        list(iter_safetensors_weights(tmp_path))
    assert_one_line_error(info.value, ErrorCode.INVALID_ARGUMENT, "corrupt safetensors file", str(path))


# --- prepare_model -----------------------------------------------------------------------------

def test_prepare_hf_dir(tmp_path: Path) -> None:
    expected = make_model_dir(tmp_path / "tiny-llama", num_shards=2)
    prepared = prepare_model(str(tmp_path / "tiny-llama"), progress=False)
    assert prepared.load_format == "safetensors"
    assert prepared.name == "tiny-llama"
    assert prepared.config.num_layers == 2 and prepared.config.head_dim == 4
    assert prepared.tokenizer_path is None  # the tiny dir has no tokenizer files
    assert_same(dict(iter_weights(prepared, progress=False)), expected)


def test_prepare_rejects_unsupported_architecture(tmp_path: Path) -> None:
    make_model_dir(tmp_path, cfg={**TINY, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(RadixMeshError) as info:
        prepare_model(str(tmp_path))
    assert_one_line_error(info.value, ErrorCode.UNSUPPORTED, "unsupported architecture", "GPT2LMHeadModel")


def test_prepare_checks_load_format(tmp_path: Path) -> None:
    make_model_dir(tmp_path)
    assert {"auto", "safetensors", "gguf", "dummy"} == LOAD_FORMATS
    with pytest.raises(RadixMeshError) as info:
        prepare_model(str(tmp_path), load_format="pt")
    assert_one_line_error(info.value, ErrorCode.INVALID_ARGUMENT, "unknown load format")
    with pytest.raises(RadixMeshError) as info:
        prepare_model(str(tmp_path), load_format="gguf")
    assert_one_line_error(info.value, ErrorCode.INVALID_ARGUMENT, "gguf")


@pytest.mark.parametrize("model", ["no/such-model", "nonexistent-name", "/no/such/dir"])
def test_unknown_model_is_one_line_not_found(model: str) -> None:
    with pytest.raises(RadixMeshError) as info:
        resolve_model_path(model)
    assert_one_line_error(info.value, ErrorCode.NOT_FOUND, f"model {model!r} not found", "smollm2-135m")


def test_default_model_from_cache_is_instant() -> None:
    out = fake_default_model()
    assert ensure_default_model() == out
    assert resolve_model_path(None) == ("smollm2-135m-instruct", out)
    assert resolve_model_path("SmolLM2-135M")[1] == out


# --- dummy -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(NAMED_SHAPES))
def test_named_shapes_build_configs(name: str) -> None:
    config = named_shape_config(name)
    assert config.num_heads * config.head_dim >= config.hidden_size // 2
    assert config.vocab_size > 30000


def test_named_shape_dims() -> None:
    llama = named_shape_config("llama-3.1-8b")
    assert (llama.num_layers, llama.hidden_size, llama.intermediate_size) == (32, 4096, 14336)
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim, llama.vocab_size) == (32, 8, 128, 128256)
    assert llama.rope_scaling is not None and llama.rope_scaling["factor"] == 8.0
    assert (named_shape_config("llama-3.2-1b").rope_scaling or {})["factor"] == 32.0
    tied = {n for n in NAMED_SHAPES if named_shape_config(n).tie_word_embeddings}
    assert tied == {"llama-3.2-1b", "llama-3.2-3b", "smollm2-135m"}
    assert named_shape_config("qwen2.5-7b").attention_bias
    assert named_shape_config("qwen3-8b").qk_norm
    smol = named_shape_config("smollm2-135m")
    assert (smol.num_layers, smol.hidden_size, smol.num_heads, smol.num_kv_heads) == (30, 576, 9, 3)


def test_prepare_dummy_named_shape_borrows_default_tokenizer() -> None:
    default_dir = fake_default_model()
    prepared = prepare_model("llama-3.1-8b", load_format="dummy")
    assert (prepared.name, prepared.load_format, prepared.model_path) == ("llama-3.1-8b", "dummy", None)
    assert prepared.tokenizer_path == default_dir
    assert prepare_model("mistral-7b", load_format="dummy").tokenizer_path is None  # vocab 32768 < 49152
    with pytest.raises(RadixMeshError):
        list(iter_weights(prepared))


def test_prepare_dummy_from_config_json(tmp_path: Path) -> None:
    fake_default_model()
    make_model_dir(tmp_path / "m")
    for model in (tmp_path / "m", tmp_path / "m" / "config.json"):
        prepared = prepare_model(str(model), load_format="dummy")
        assert prepared.config == ModelConfig.from_hf_dict(TINY)
        assert prepared.name == "m"
    with pytest.raises(RadixMeshError) as info:
        prepare_model("no-such-shape", load_format="dummy")
    assert_one_line_error(info.value, ErrorCode.NOT_FOUND, "llama-3.1-8b")


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(16))


class _TinyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(64, 16)
        self.q_proj = nn.Linear(16, 16, bias=True)
        self.input_layernorm = _Norm()
        self.lm_head = nn.Linear(16, 64, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied


def test_init_dummy_fills_in_place_and_is_seeded() -> None:
    a, b = _TinyBlock(), _TinyBlock()
    ptr = a.q_proj.weight.data_ptr()
    init_dummy_(a, seed=3)
    init_dummy_(b, seed=3)
    assert a.q_proj.weight.data_ptr() == ptr
    assert torch.equal(a.q_proj.weight, b.q_proj.weight)
    assert 0.01 < a.q_proj.weight.std().item() < 0.04
    assert torch.equal(a.input_layernorm.weight, torch.ones(16))
    assert torch.equal(a.q_proj.bias, torch.zeros(16))
    assert a.lm_head.weight is a.embed_tokens.weight


__all__ = ["isolated_cache"]  # the autouse fixture
