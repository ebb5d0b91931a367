"""Random weights for benchmarks: named model shapes and an in-place initializer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixmesh.common.errors import not_found
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.registry import model_type_of

if TYPE_CHECKING:
    from torch import nn


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


def _shape(arch: str, layers: int, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int,
           vocab: int, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": [arch], "model_type": model_type_of(arch), "num_hidden_layers": layers,
        "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    }
    cfg.update(extra)
    return cfg


_LLAMA3_TOKENS = {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}
_QWEN_TOKENS = {"bos_token_id": 151643, "eos_token_id": [151645, 151643]}

# Published config.json dims of each model (instruct variants' special tokens).
NAMED_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": _shape("LlamaForCausalLM", 32, 4096, 14336, 32, 8, 128, 128256, rope_theta=500000.0,
                           rope_scaling=_llama3_rope(8.0), max_position_embeddings=131072,
                           **_LLAMA3_TOKENS),
    "llama-3.1-70b": _shape("LlamaForCausalLM", 80, 8192, 28672, 64, 8, 128, 128256, rope_theta=500000.0,
                            rope_scaling=_llama3_rope(8.0), max_position_embeddings=131072,
                            **_LLAMA3_TOKENS),
    "llama-3.2-1b": _shape("LlamaForCausalLM", 16, 2048, 8192, 32, 8, 64, 128256, rope_theta=500000.0,
                           rope_scaling=_llama3_rope(32.0), max_position_embeddings=131072,
                           tie_word_embeddings=True, **_LLAMA3_TOKENS),
    "llama-3.2-3b": _shape("LlamaForCausalLM", 28, 3072, 8192, 24, 8, 128, 128256, rope_theta=500000.0,
                           rope_scaling=_llama3_rope(32.0), max_position_embeddings=131072,
                           tie_word_embeddings=True, **_LLAMA3_TOKENS),
    "qwen2.5-7b": _shape("Qwen2ForCausalLM", 28, 3584, 18944, 28, 4, 128, 152064, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, max_position_embeddings=32768, attention_bias=True,
                         **_QWEN_TOKENS),
    "qwen3-8b": _shape("Qwen3ForCausalLM", 36, 4096, 12288, 32, 8, 128, 151936, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, max_position_embeddings=40960, **_QWEN_TOKENS),
    # Mistral-7B-v0.3 (v0.1/v0.2 differ: vocab 32000, rope_theta 10000, sliding window).
    "mistral-7b": _shape("MistralForCausalLM", 32, 4096, 14336, 32, 8, 128, 32768, rope_theta=1000000.0,
                         max_position_embeddings=32768, bos_token_id=1, eos_token_id=2),
    # Qwen3-30B-A3B: 128 experts of width 768, 8 per token, on every layer (~3.3B active of 30.5B).
    "qwen3-30b-a3b": _shape("Qwen3MoeForCausalLM", 48, 2048, 6144, 32, 4, 128, 151936, rope_theta=1000000.0,
                            rms_norm_eps=1e-6, max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                            **_QWEN_TOKENS),
    # Mixtral-8x7B-v0.1: 8 experts of width 14336, 2 per token (~12.9B active of 46.7B).
    "mixtral-8x7b": _shape("MixtralForCausalLM", 32, 4096, 14336, 32, 8, 128, 32000, rope_theta=1000000.0,
                           max_position_embeddings=32768, num_local_experts=8, num_experts_per_tok=2, bos_token_id=1,
                           eos_token_id=2),
    "smollm2-135m": _shape("LlamaForCausalLM", 30, 576, 1536, 9, 3, 64, 49152, rope_theta=100000.0,
                           max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
                           eos_token_id=2),
}


# Published config.json of the multimodal models (llava-hf/llava-1.5-7b-hf, Qwen/Qwen2-VL-7B-Instruct).
NAMED_SHAPES["llava-1.5-7b"] = {
    "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 32000,
    "projector_hidden_act": "gelu", "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
    "text_config": _shape("LlamaForCausalLM", 32, 4096, 11008, 32, 32, 128, 32064, max_position_embeddings=4096,
                          rope_theta=10000.0, bos_token_id=1, eos_token_id=2, torch_dtype="float16"),
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                      "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336, "patch_size": 14,
                      "projection_dim": 768, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
}
NAMED_SHAPES["qwen2-vl-7b"] = {
    **_shape("Qwen2ForCausalLM", 28, 3584, 18944, 28, 4, 128, 152064, rope_theta=1000000.0, rms_norm_eps=1e-6,
             max_position_embeddings=32768, attention_bias=True, **_QWEN_TOKENS),
    "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
    "vision_start_token_id": 151652, "vision_end_token_id": 151653, "image_token_id": 151655,
    "video_token_id": 151656, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "hidden_size": 3584,
                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
}
NAMED_SHAPES["qwen2.5-vl-7b"] = {
    **NAMED_SHAPES["qwen2-vl-7b"], "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    "max_position_embeddings": 128000,
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu"},
}


def named_shape_config(name: str) -> ModelConfig:
    """The ModelConfig of a named shape; unknown names list the known ones."""
    cfg = NAMED_SHAPES.get(name.lower())
    if cfg is None:
        raise not_found(f"unknown model shape {name!r} (known: {', '.join(sorted(NAMED_SHAPES))})")
    return ModelConfig.from_hf_dict(cfg)


def init_dummy_(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place: N(0, 0.02) matrices, ones for norm weights, zero biases.

    Works on whatever device the parameters live on (one generator per device), so GPU
    models are filled on the GPU without a host copy. Tied parameters are filled once.
    """
    import torch

    with torch.no_grad():
        _fill_dummy_(model, seed)


def _fill_dummy_(model: nn.Module, seed: int) -> None:
    import torch

    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.device.type == "meta" or param.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            continue  # quantized layers are filled by their method (`LinearMethod.fill_dummy`)
        if param.dim() >= 2:
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(device=param.device)
                gen.manual_seed(seed)
            param.normal_(0.0, 0.02, generator=gen)
        elif name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.zero_()
