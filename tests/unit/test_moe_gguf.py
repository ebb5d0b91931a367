"""Qwen3-MoE (`qwen3moe`) and Mixtral (`llama` with experts) GGUF files: converted back to the Hugging Face
checkpoint they were written from, and served with transformers' greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from safetensors.torch import load_file

from radixmesh.engine.loader import prepare_model
from radixmesh.engine.loader.gguf_convert import convert_gguf_to_hf_dir, permute_rope
from radixmesh.engine.loader.safetensors_loader import iter_safetensors_weights

from .moe_factory import PROMPTS, hf_greedy, write_hf_checkpoint
from .test_moe_models import greedy

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
          "block_sparse_moe.gate": "ffn_gate_inp"}
_STACKS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
           "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def write_moe_gguf(path: Path, hf_dir: Path, arch: str) -> dict[str, np.ndarray]:
    """A GGUF file as llama.cpp writes the checkpoint in `hf_dir` (experts stacked, llama's q/k rope-permuted);
    returns the checkpoint's tensors."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = {n: t.numpy() for n, t in load_file(str(hf_dir / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), arch)
    _write_metadata(w, cfg, arch)
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in tensors.items():
        if name in _GLOBAL:
            w.add_tensor(_GLOBAL[name], np.ascontiguousarray(tensor))
            continue
        _, _, layer, rest = name.split(".", 3)
        module = rest.removesuffix(".weight")
        if ".experts." in module:
            _, expert, projection = module.rsplit(".", 2)
            stacks.setdefault(f"blk.{layer}.{_STACKS[projection]}.weight", {})[int(expert)] = tensor
            continue
        heads = {"self_attn.q_proj": cfg["num_attention_heads"], "self_attn.k_proj": cfg["num_key_value_heads"]}
        data = permute_rope(tensor, heads[module]) if arch == "llama" and module in heads else tensor
        w.add_tensor(f"blk.{layer}.{_LAYER[module]}.weight", np.ascontiguousarray(data))
    for name, experts in stacks.items():
        w.add_tensor(name, np.ascontiguousarray(np.stack([experts[e] for e in sorted(experts)])))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def _write_metadata(w: Any, cfg: dict[str, Any], arch: str) -> None:
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_tokenizer_model("gpt2")
    vocab = cfg["vocab_size"]
    w.add_token_list(["a", "b", "ab"] + [f"t{i}" for i in range(vocab - 5)] + ["<s>", "</s>"])
    w.add_token_types([1] * vocab)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXMESH_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize(("kind", "arch", "architecture"), [
    ("qwen3_moe", "qwen3moe", "Qwen3MoeForCausalLM"), ("qwen3_moe_step2", "qwen3moe", "Qwen3MoeForCausalLM"),
    ("mixtral", "llama", "MixtralForCausalLM")])
def test_moe_gguf_converts_back_and_serves(tmp_path: Path, kind: str, arch: str, architecture: str) -> None:
    hf_dir, hf = write_hf_checkpoint(kind, tmp_path / "hf")
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = write_moe_gguf(tmp_path / f"{kind}.gguf", hf_dir, arch)
    out = convert_gguf_to_hf_dir(tmp_path / f"{kind}.gguf", tmp_path / "out", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [architecture]
    num_experts = hf_cfg.get("num_experts") or hf_cfg["num_local_experts"]
    if arch == "qwen3moe":
        dense = [1] if kind == "qwen3_moe" else [0, 2]  # step 2 is written as its dense layers
        assert (cfg["num_experts"], cfg["moe_intermediate_size"], cfg["norm_topk_prob"], cfg["mlp_only_layers"]) == (
            num_experts, hf_cfg["moe_intermediate_size"], hf_cfg["norm_topk_prob"], dense)
    else:
        assert cfg["num_local_experts"] == num_experts
    assert cfg["num_experts_per_tok"] == hf_cfg["num_experts_per_tok"]
    loaded = dict(iter_safetensors_weights(out, progress=False))
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(loaded[name].numpy(), tensor, err_msg=name)
    prepared = prepare_model(str(tmp_path / f"{kind}.gguf"), progress=False)
    assert prepared.load_format == "gguf" and prepared.model_path is not None
    assert greedy(prepared.model_path, PROMPTS, 8) == hf_greedy(hf, PROMPTS, 8)
