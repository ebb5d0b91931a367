"""Tiny Qwen3, Qwen3-MoE and Mixtral checkpoints saved by transformers, and their greedy tokens from transformers.

Weights are wider than transformers' default init (std 0.3; norm weights drawn in [0.5, 1.5], so a norm that is
not loaded shows), which keeps greedy tokens clear of near-ties between two implementations' rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

COMMON: dict[str, Any] = dict(vocab_size=101, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=0.3,
                              tie_word_embeddings=False)
KINDS: dict[str, dict[str, Any]] = {
    "qwen3": dict(intermediate_size=48),
    # layer 1 dense (mlp_only_layers), layers 0 and 2 sparse; renormalized top-3 of 8
    "qwen3_moe": dict(intermediate_size=48, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3,
                      decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True),
    # every second layer sparse (layer 1 only), top-2 of 6 not renormalized
    "qwen3_moe_step2": dict(intermediate_size=48, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2,
                            decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False),
    "mixtral": dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2),
}
PROMPTS = [[5, 9, 13, 2, 77, 41], [3, 3, 8], list(range(10, 30))]


def hf_model(kind: str, seed: int = 0, **overrides: Any) -> Any:
    """A random transformers model of `kind` (a key of KINDS; config fields replaced by `overrides`), float32, eval
    mode."""
    import transformers

    fields = {**COMMON, **KINDS[kind], **overrides}
    if kind == "qwen3":
        config, cls = transformers.Qwen3Config(**fields), transformers.Qwen3ForCausalLM
    elif kind.startswith("qwen3_moe"):
        config, cls = transformers.Qwen3MoeConfig(**fields), transformers.Qwen3MoeForCausalLM
    else:
        config, cls = transformers.MixtralConfig(**fields), transformers.MixtralForCausalLM
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5)
    return model


def write_hf_checkpoint(kind: str, path: Path, seed: int = 0, **overrides: Any) -> tuple[Path, Any]:
    """`save_pretrained` of `hf_model(kind, seed, **overrides)` into `path`; returns the directory and the model."""
    model = hf_model(kind, seed, **overrides)
    model.save_pretrained(str(path))
    return path, model


@torch.no_grad()
def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (exactly `max_new_tokens` tokens)."""
    out = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False)
        out.append(ids[0, len(prompt):].tolist())
    return out
