"""Tiny EAGLE and EAGLE-3 heads in their published checkpoint layouts (safetensors + config.json) for the
scheduler factory's tiny target (`tiny_model_config()`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tests.unit.scheduler_factory import VOCAB

HIDDEN, INTER = 32, 64
HEADS = (4, 2, 8)
"""(query heads, KV heads, head width) of the heads' attention by default; the Triton kernels want (2, 1, 16)."""


def _layer_config(heads: tuple[int, int, int]) -> dict[str, Any]:
    return {"hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": 1, "num_attention_heads": heads[0],
            "num_key_value_heads": heads[1], "head_dim": heads[2], "max_position_embeddings": 128,
            "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}


def _attention_and_mlp(prefix: str, in_dim: int, gen: torch.Generator, identity: bool,
                       heads: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    """One Llama layer's projections; `identity`: attention and MLP add nothing (o_proj and down_proj zero)."""
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2

    num_heads, kv_heads, head_dim = heads
    out = {
        f"{prefix}.self_attn.q_proj.weight": rand(num_heads * head_dim, in_dim),
        f"{prefix}.self_attn.k_proj.weight": rand(kv_heads * head_dim, in_dim),
        f"{prefix}.self_attn.v_proj.weight": rand(kv_heads * head_dim, in_dim),
        f"{prefix}.self_attn.o_proj.weight": rand(HIDDEN, num_heads * head_dim),
        f"{prefix}.mlp.gate_proj.weight": rand(INTER, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": rand(INTER, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": rand(HIDDEN, INTER),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(HIDDEN),
    }
    if identity:
        out[f"{prefix}.self_attn.o_proj.weight"].zero_()
        out[f"{prefix}.mlp.down_proj.weight"].zero_()
    return out


def write_eagle(path: Path, seed: int = 0, identity: bool = False, heads: tuple[int, int, int] = HEADS,
                bigram: bool = False) -> Path:
    """An EAGLE (1/2) head as published: config.json saying LlamaForCausalLM, `fc` with a bias over
    cat(embedding, feature), `layers.0` without an input norm, no embedding and no LM head (the target's).
    `identity`: fc passes the feature through and the layer adds nothing, so the head's logits are the target's
    at the same position (its first draft is then the request's last token, under greedy decoding).
    `bigram`: fc passes the embedding through and the layer adds nothing, so the head's logits at a token are the
    LM head over that token's embedding (a target whose layers add little then mostly agrees: `make_bigram_like`)."""
    gen = torch.Generator().manual_seed(seed)
    fc = torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) * 0.2
    if identity:
        fc = torch.cat([torch.zeros(HIDDEN, HIDDEN), torch.eye(HIDDEN)], dim=1)
    if bigram:
        fc = torch.cat([torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)], dim=1)
        identity = True
    tensors = {"fc.weight": fc, "fc.bias": torch.zeros(HIDDEN),
               **_attention_and_mlp("layers.0", HIDDEN, gen, identity, heads)}
    return _write(path, {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": True,
                         **_layer_config(heads)}, tensors)


def write_eagle3(path: Path, seed: int = 0, draft_vocab: int = 64, identity_of: Any = None,
                 layer_ids: tuple[int, int, int] = (0, 0, 1), heads: tuple[int, int, int] = HEADS) -> Path:
    """An EAGLE-3 head as published: `fc` over three target features, `midlayer.*` with input_layernorm and
    hidden_norm, q/k/v over 2 * hidden inputs, its own `norm` and `lm_head` over `draft_vocab` tokens, `d2t`
    offsets and a `t2d` mask; no embedding (the target's). `eagle_aux_hidden_state_layer_ids` (0, 0, 1) reads the
    inputs of the tiny target's layers 1, 1 and 2 (2: its last layer's output).
    `identity_of`: a target model whose final norm and LM head the head copies, with fc picking the third feature
    and the layer adding nothing: the head's logits are then the target's over the draft vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    draft_ids = torch.randperm(VOCAB, generator=gen)[:draft_vocab]  # any order: d2t offsets map them back
    tensors = {
        "fc.weight": torch.randn(HIDDEN, 3 * HIDDEN, generator=gen) * 0.2,
        **_attention_and_mlp("midlayer", 2 * HIDDEN, gen, identity_of is not None, heads),
        "midlayer.input_layernorm.weight": torch.ones(HIDDEN),
        "midlayer.hidden_norm.weight": torch.ones(HIDDEN),
        "norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": torch.randn(draft_vocab, HIDDEN, generator=gen) * 0.2,
        "d2t": draft_ids - torch.arange(draft_vocab),
        "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, draft_ids, True),
    }
    if identity_of is not None:
        tensors["fc.weight"] = torch.cat([torch.zeros(HIDDEN, 2 * HIDDEN), torch.eye(HIDDEN)], dim=1)
        tensors["norm.weight"] = identity_of.model.norm.weight.detach().clone()
        tensors["lm_head.weight"] = identity_of.lm_head.weight.detach()[draft_ids].clone()
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "draft_vocab_size": draft_vocab,
              "target_hidden_size": HIDDEN, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)},
              **_layer_config(heads)}
    return _write(path, config, tensors)


def _write(path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def make_bigram_like(model: Any, scale: float) -> None:
    """Shrink a tiny target's attention and MLP outputs by `scale` and make its final norm plain: its greedy token then
    mostly follows the last token's embedding, as a `bigram` head predicts (often its top-1, else among its top few)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(scale)
        model.model.norm.weight.fill_(1.0)
