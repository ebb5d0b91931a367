"""Mixture-of-experts GGUF files (llama.cpp's layout) -> Hugging Face config fields and tensor names.

llama.cpp writes a Qwen3-MoE model under `general.architecture = qwen3moe` and a Mixtral model under `llama` with
`llama.expert_count`; both with the metadata `{arch}.expert_count`, `{arch}.expert_used_count` (and for qwen3moe
`{arch}.expert_feed_forward_length`, optionally `{arch}.expert_weights_norm`), the router as
`blk.N.ffn_gate_inp` `[E, H]` and each projection's experts stacked in one tensor: `blk.N.ffn_gate_exps` and
`ffn_up_exps` `[E, I, H]`, `ffn_down_exps` `[E, H, I]`. Layers without stacks (Qwen3-MoE's `mlp_only_layers`)
keep a dense `ffn_gate`/`ffn_up`/`ffn_down`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

_MOE_TENSOR = re.compile(r"blk\.(\d+)\.(ffn_gate_inp|ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.weight")
_PROJECTIONS = {  # GGUF stack -> the Hugging Face projection name, Qwen3-MoE's and Mixtral's
    "ffn_gate_exps": ("gate_proj", "w1"), "ffn_up_exps": ("up_proj", "w3"), "ffn_down_exps": ("down_proj", "w2")}
STACK_SUFFIX = "_exps"
"""Ends the provisional name of a stack (`...experts.gate_proj_exps`) until `split_expert_stack` cuts it."""


def moe_config_fields(arch: str, field: Callable[..., Any], tensor_names: set[str],
                      num_layers: int) -> dict[str, Any]:
    """config.json fields of a GGUF file's experts ({} for a dense model); a llama file with experts is Mixtral."""
    num_experts = int(field(f"{arch}.expert_count", 0) or 0)
    if num_experts == 0:
        return {}
    top_k = int(field(f"{arch}.expert_used_count"))
    if arch == "llama":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": num_experts,
                "num_experts_per_tok": top_k}
    sparse = {i for i in range(num_layers) if f"blk.{i}.ffn_gate_exps.weight" in tensor_names}
    return {"num_experts": num_experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(field(f"{arch}.expert_feed_forward_length")),
            "norm_topk_prob": bool(field(f"{arch}.expert_weights_norm", True)), "decoder_sparse_step": 1,
            "mlp_only_layers": sorted(set(range(num_layers)) - sparse)}


def expert_stack_name(gguf_name: str, config: dict[str, Any]) -> str | None:
    """The Hugging Face name of a router tensor, or the provisional name of an expert stack; None for others."""
    match = _MOE_TENSOR.fullmatch(gguf_name)
    if match is None:
        return None
    mixtral = config.get("model_type") == "mixtral"
    block = f"model.layers.{match.group(1)}.{'block_sparse_moe' if mixtral else 'mlp'}"
    if match.group(2) == "ffn_gate_inp":
        return f"{block}.gate.weight"
    return f"{block}.experts.{_PROJECTIONS[match.group(2)][int(mixtral)]}{STACK_SUFFIX}"


def split_expert_stack(name: str, stack: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """A stack `[E, rows, cols]` under its provisional name as one Hugging Face tensor per expert."""
    parent, _, leaf = name.rpartition(".")
    projection = leaf.removesuffix(STACK_SUFFIX)
    for e in range(stack.shape[0]):
        yield f"{parent}.{e}.{projection}.weight", stack[e]
