"""Small factories for loader tests: tiny Hugging Face directories, a private model cache, error checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.loader.default_model import COMPLETE_MARKER, default_model_dir

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
        "max_position_embeddings": 128, "tie_word_embeddings": False}


def make_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors with Hugging Face names and shapes for a llama-style config."""
    g = torch.Generator().manual_seed(seed)
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h),
                                          "model.norm.weight": (h,), "lm_head.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def make_model_dir(root: Path, cfg: dict[str, Any] = TINY, num_shards: int = 1,
                   with_index: bool = True) -> dict[str, torch.Tensor]:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    weights = make_weights(cfg)
    if num_shards == 1:
        save_file(weights, str(root / "model.safetensors"))
        return weights
    names = sorted(weights)
    weight_map: dict[str, str] = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: weights[n] for n in names[i::num_shards]}
        save_file(part, str(root / file))
        weight_map |= dict.fromkeys(part, file)
    if with_index:
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return weights


def assert_same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)


def assert_one_line_error(exc: RadixMeshError, code: ErrorCode, *fragments: str) -> None:
    assert exc.code == code, exc
    assert "\n" not in exc.message
    for fragment in fragments:
        assert fragment in exc.message, exc.message


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("RADIXMESH_CACHE_DIR", str(cache))
    monkeypatch.delenv("RADIXMESH_ALLOW_HUB", raising=False)
    return cache


def fake_default_model() -> Path:
    """A complete-looking default model in the (temporary) cache, so nothing is downloaded."""
    out = default_model_dir()
    out.mkdir(parents=True)
    (out / "tokenizer.json").write_text("{}")
    (out / COMPLETE_MARKER).write_text("test\n")
    return out
