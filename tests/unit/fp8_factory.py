"""Small FP8 fixtures shared by the CPU and GPU tests: a tiny Llama config, runners, and checkpoints written
as FP8 exporters write them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from radixmesh.engine.config import EngineConfig
from radixmesh.engine.loader import PreparedModel, prepare_model
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.kernels.fp8_ref import quantize_rows

E4M3 = torch.float8_e4m3fn
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 256,
             "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
             "head_dim": 32, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
             "torch_dtype": "float32"}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_runner(model: str | ModelConfig, **overrides: Any) -> ModelRunner:
    """A ModelRunner of a checkpoint directory, or of random weights of a ModelConfig (CPU float32 by default)."""
    settings: dict[str, Any] = dict(device="cpu", dtype="float32", max_total_tokens=4096, max_running_requests=64)
    settings.update(overrides)
    if isinstance(model, ModelConfig):
        config = EngineConfig(load_format="dummy", **settings).resolve()
        return ModelRunner(config, PreparedModel("tiny", model, "dummy", None, None))
    config = EngineConfig(model=model, **settings).resolve()
    return ModelRunner(config, prepare_model(model, "auto", progress=False))


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None = None) -> str:
    path.mkdir(parents=True, exist_ok=True)
    config = dict(HF_CONFIG, quantization_config=quantization_config) if quantization_config else HF_CONFIG
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return str(path)


def quantized(weights: dict[str, torch.Tensor], per_tensor: bool, extra: bool = True) -> dict[str, torch.Tensor]:
    """The checkpoint an FP8 exporter would write: projections in FP8 with weight_scale (and input_scale)."""
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        module = name.rpartition(".")[0]
        if module.rpartition(".")[2] not in PROJECTIONS:
            out[name] = w
            continue
        if per_tensor:
            scale = w.abs().max() / 448.0
            out[name], out[f"{module}.weight_scale"] = (w / scale).clamp(-448, 448).to(E4M3), scale.reshape(())
        else:
            q, s = quantize_rows(w)
            out[name], out[f"{module}.weight_scale"] = q, s[:, None]  # [N, 1], as exporters write it
        if extra:
            out[f"{module}.input_scale"] = torch.tensor(0.05)
    return out
