"""Factories for LoRA tests: random PEFT adapters of a tiny random Llama, and Hugging Face PEFT's greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_model(model_dir: Path) -> Any:
    """The checkpoint as a Hugging Face Llama (float32, eval)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()


def write_random_adapter(model_dir: Path, out_dir: Path, rank: int, seed: int, targets: list[str] | None = None,
                         alpha: int = 16, use_rslora: bool = False, scale: float = 0.3) -> Path:
    """A PEFT LoRA adapter of the checkpoint with random A and B (B nonzero, so it changes the output),
    saved as adapter_config.json + adapter_model.safetensors."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, lora_dropout=0.0,
                        use_rslora=use_rslora, init_lora_weights=False)
    peft_model = get_peft_model(hf_model(model_dir), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale / param.shape[-1] ** 0.5)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


def peft_greedy(model_dir: Path, adapter_dir: Path | None, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of Hugging Face PEFT (the base model without an adapter)."""
    model = hf_model(model_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]
