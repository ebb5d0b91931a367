"""Factories for tensor-parallel tests: a tiny random checkpoint on disk and schedulers at any TP size.

The checkpoint has wide random weights (well-separated logits), so greedy tokens do not flip on
the last-bit differences of summing partial results in another order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from radixmesh.engine.config import EngineConfig
from radixmesh.engine.loader import prepare_model
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.engine.scheduler.core import Scheduler

from .scheduler_factory import Collector

TINY_SHAPE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
    "vocab_size": 101, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "torch_dtype": "float32", "eos_token_id": 100,
}
"""8 query heads over 2 KV heads (replicated at TP 4); 101 tokens (vocabulary rows padded at TP 2 and 4)."""


def write_tiny_checkpoint(path: Path, seed: int = 7, **overrides: Any) -> Path:
    """A Hugging Face directory (config.json, model.safetensors with separate q/k/v and gate/up)."""
    from safetensors.torch import save_file

    cfg = {**TINY_SHAPE, **overrides}
    config = ModelConfig.from_hf_dict(cfg)
    gen = torch.Generator().manual_seed(seed)
    h, kvh, d = config.num_heads, config.num_kv_heads, config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * 0.5

    tensors = {"model.embed_tokens.weight": rand(config.vocab_size, hidden), "model.norm.weight": torch.ones(hidden)}
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = rand(config.vocab_size, hidden)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": rand(h * d, hidden),
                    p + "self_attn.k_proj.weight": rand(kvh * d, hidden),
                    p + "self_attn.v_proj.weight": rand(kvh * d, hidden),
                    p + "self_attn.o_proj.weight": rand(hidden, h * d),
                    p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
                    p + "mlp.down_proj.weight": rand(hidden, inter), p + "input_layernorm.weight": torch.ones(hidden),
                    p + "post_attention_layernorm.weight": torch.ones(hidden)}
        if config.attention_bias:
            tensors |= {p + "self_attn.q_proj.bias": rand(h * d), p + "self_attn.k_proj.bias": rand(kvh * d),
                        p + "self_attn.v_proj.bias": rand(kvh * d)}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def make_tp_scheduler(model: str | Path | None, tp_size: int, load_format: str = "auto", tokenizer: Any = None,
                      **overrides: Any) -> tuple[Scheduler, Collector]:
    """A scheduler on the CPU in fp32 whose runner is rank 0 of `tp_size` (ranks 1.. are processes);
    call `close_scheduler` when done."""
    settings: dict[str, Any] = dict(device="cpu", dtype="float32", max_total_tokens=4096, max_running_requests=16,
                                    tp_size=tp_size, load_format=load_format,
                                    model=str(model) if model is not None else None)
    settings.update(overrides)
    config = EngineConfig(**settings).resolve()
    prepared = prepare_model(config.model, config.load_format, progress=False, lend_tokenizer=False)
    runner = ModelRunner(config, prepared)
    collector = Collector()
    return Scheduler(config, runner, tokenizer, collector), collector


def close_scheduler(sched: Scheduler) -> list[int]:
    """Stop the scheduler's other ranks; returns their (now exited) process ids."""
    leader = sched.runner.tp_leader
    pids = leader.pids if leader is not None else []
    sched.runner.close()
    return pids


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
