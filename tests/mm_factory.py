"""Tiny multimodal checkpoints for tests: random weights of LLaVA and Qwen2-VL shapes, saved by
Hugging Face transformers with the default model's tokenizer (plus the image special tokens) and a
processor config, so the engine loads them as it loads published checkpoints.
"""

from __future__ import annotations

import base64
import io
import shutil
from pathlib import Path
from typing import Any

import numpy as np

IMAGE_TOKENS = ("<image>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
VOCAB_SIZE = 49216
"""The tiny models' vocabulary: the default tokenizer's 49152 ids, the image tokens, some spare rows."""
LLAVA_IMAGE_SIZE = 28
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 28 * 28, 28 * 28 * 12


def tokenizer_dir(default_model_dir: Path, out: Path) -> Path:
    """The default model's tokenizer with the image special tokens added (ids 49152..49155)."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    tok.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    tok.save_pretrained(str(out))
    if (default_model_dir / "chat_template.jinja").is_file():
        shutil.copy(default_model_dir / "chat_template.jinja", out / "chat_template.jinja")
    return out


def token_ids(tok_dir: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    return {t: int(tok.convert_tokens_to_ids(t)) for t in IMAGE_TOKENS}


def _text_config(**extra: Any) -> dict[str, Any]:
    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": VOCAB_SIZE, "bos_token_id": 1, "eos_token_id": 2,
           "max_position_embeddings": 1024, "rms_norm_eps": 1e-6}
    cfg.update(extra)
    return cfg


def llava_dir(tok_dir: Path, out: Path, seed: int = 0) -> Path:
    """A LLaVA of CLIP (28 px images, 4 patches) and Llama (2 layers, width 64), saved with its processor."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    ids = token_ids(tok_dir)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=LLAVA_IMAGE_SIZE, patch_size=14, projection_dim=16)
    config = LlavaConfig(vision_config=vision, text_config=LlamaConfig(**_text_config()),
                         image_token_index=ids["<image>"], vision_feature_layer=-2,
                         vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    _scale_up(model)
    model.save_pretrained(str(out))
    _copy_tokenizer(tok_dir, out)
    llava_processor(out).image_processor.save_pretrained(str(out))
    return out


def qwen2_vl_dir(tok_dir: Path, out: Path, seed: int = 0) -> Path:
    """A Qwen2-VL (vision: 2 blocks of width 32; text: 2 layers of width 64), saved with its processor."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = token_ids(tok_dir)
    text = _text_config(rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 4, "mlp_ratio": 2, "patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2}
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                           video_token_id=ids["<|image_pad|>"] + 100)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    _scale_up(model)
    model.save_pretrained(str(out))
    _copy_tokenizer(tok_dir, out)
    qwen2_vl_image_processor().save_pretrained(str(out))
    return out


def qwen2_5_vl_dir(tok_dir: Path, out: Path, seed: int = 0) -> Path:
    """A Qwen2.5-VL: 4 vision blocks of width 32 (windows of 2x2 merged tokens, blocks 1 and 3 full), text as
    qwen2_vl_dir's."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = token_ids(tok_dir)
    text = _text_config(rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    vision = {"depth": 4, "hidden_size": 32, "intermediate_size": 48, "num_heads": 4, "out_hidden_size": 64,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
              "fullatt_block_indexes": [1, 3]}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"], video_token_id=ids["<|image_pad|>"] + 100)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    _scale_up(model)
    model.save_pretrained(str(out))
    _copy_tokenizer(tok_dir, out)
    qwen2_vl_image_processor().save_pretrained(str(out))
    return out


def _scale_up(model: Any) -> None:
    """Random init at std 0.02 makes greedy decoding of tiny models collapse onto one token; wider
    weights give varied tokens (what a comparison of token sequences needs)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.25 if "embed" not in name else 1.0)


def _copy_tokenizer(tok_dir: Path, out: Path) -> None:
    for file in tok_dir.iterdir():
        if file.is_file() and file.name != "config.json":
            shutil.copy(file, out / file.name)


def _pil_processor_class(module: str, name: str) -> Any:
    """Transformers' PIL image processor class (`<name>Pil` in 5.x); older releases' slow class is PIL-based."""
    import importlib

    try:
        return getattr(importlib.import_module(f"transformers.models.{module}"), f"{name}Pil")
    except (ImportError, AttributeError):
        import transformers

        return getattr(transformers, name)


def llava_processor(model_dir: Path) -> Any:
    from transformers import AutoTokenizer, LlavaProcessor

    clip = _pil_processor_class("clip.image_processing_pil_clip", "CLIPImageProcessor")
    image = clip(size={"shortest_edge": LLAVA_IMAGE_SIZE},
                 crop_size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE})
    return LlavaProcessor(image_processor=image, tokenizer=AutoTokenizer.from_pretrained(str(model_dir)),
                          patch_size=14, vision_feature_select_strategy="default", image_token="<image>",
                          num_additional_image_tokens=1)


def qwen2_vl_image_processor() -> Any:
    """Hugging Face's PIL image processor of Qwen2-VL (its full processor needs torchvision for videos)."""
    qwen = _pil_processor_class("qwen2_vl.image_processing_pil_qwen2_vl", "Qwen2VLImageProcessor")
    return qwen(min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS)


def image_png(seed: int, width: int = 40, height: int = 30) -> bytes:
    """A random RGB image as PNG bytes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def default_tokenizer_source() -> Path:
    """The default model's directory (its tokenizer files): RADIXMESH_TEST_TOKENIZER_DIR on machines without
    network (the GPU machine), else the converted default model."""
    import os

    staged = os.environ.get("RADIXMESH_TEST_TOKENIZER_DIR")
    if staged and Path(staged).is_dir():
        return Path(staged)
    from radixmesh.engine.loader.default_model import ensure_default_model

    return ensure_default_model()


def pil(png: bytes) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(png)).convert("RGB")


def hf_llava_greedy(model_dir: Path, prompt: str, pngs: list[bytes], max_new_tokens: int,
                    device: str = "cpu") -> list[int]:
    """Greedy tokens of Hugging Face's LlavaForConditionalGeneration with its own processor (EOS ignored)."""
    import torch
    from transformers import LlavaForConditionalGeneration

    inputs = llava_processor(model_dir)(images=[pil(p) for p in pngs], text=prompt, return_tensors="pt").to(device)
    model = LlavaForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    return _greedy(model, inputs, max_new_tokens)


def hf_qwen2_vl_greedy(model_dir: Path, prompt: str, pngs: list[bytes], max_new_tokens: int,
                       device: str = "cpu") -> list[int]:
    """Greedy tokens of Hugging Face's Qwen2VL (or Qwen2.5-VL) ForConditionalGeneration; each `<|image_pad|>`
    of `prompt` is expanded to its image's token count as Qwen2VLProcessor does."""
    import json

    import torch
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    pixels = qwen2_vl_image_processor()(images=[pil(p) for p in pngs], return_tensors="pt")
    text = prompt
    for grid in pixels["image_grid_thw"]:
        text = text.replace("<|image_pad|>", "<|placeholder|>" * int(grid.prod() // 4), 1)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    enc = tok(text.replace("<|placeholder|>", "<|image_pad|>"), return_tensors="pt")
    image_token = tok.convert_tokens_to_ids("<|image_pad|>")
    inputs = {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask, "pixel_values": pixels["pixel_values"],
              "image_grid_thw": pixels["image_grid_thw"], "mm_token_type_ids": (enc.input_ids == image_token).int()}
    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    cls = Qwen2_5_VLForConditionalGeneration if arch.startswith("Qwen2_5") else Qwen2VLForConditionalGeneration
    model = cls.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    inputs = {k: v.to(device) for k, v in inputs.items()}
    try:
        return _greedy(model, inputs, max_new_tokens)
    except (TypeError, ValueError):  # releases before mm_token_type_ids find the image tokens by id
        inputs.pop("mm_token_type_ids")
        return _greedy(model, inputs, max_new_tokens)


def _greedy(model: Any, inputs: Any, max_new_tokens: int) -> list[int]:
    import torch

    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return [int(t) for t in out[0, inputs["input_ids"].shape[1]:]]
