"""What the edge must know about a multimodal model: its image token, tokens per image, processor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixmesh.engine.mm.processors import CLIP_MEAN, CLIP_STD
from radixmesh.engine.model_config import ModelConfig

DEFAULT_LLAVA_IMAGE_TOKEN = 32000
DEFAULT_QWEN2_VL_TOKENS = {"image_token_id": 151655, "vision_start_token_id": 151652, "vision_end_token_id": 151653}


@dataclass(frozen=True)
class VisionSpec:
    """The image side of a multimodal model, read from its config.json."""

    family: str
    """Model family: llava | qwen2_vl | qwen2_5_vl."""
    image_token_id: int
    """The placeholder token a prompt holds once per image; expanded to the image's tokens."""
    wrap_token_ids: tuple[int, ...]
    """Tokens around the placeholder in chat text (Qwen2-VL: vision start and end); empty for LLaVA."""
    image_separator: str
    """Text after an image in a chat message with text after it ("\\n" for LLaVA, none for Qwen2-VL)."""
    processor_id: str
    """Default image processor (IMAGE_PROCESSORS id) when the processor config names none."""
    tokens_per_image: int
    """Tokens of one image for fixed-size towers; 0 where it depends on the image (Qwen2-VL)."""
    default_processor_config: dict[str, Any]
    """The processor config of the published model, used when the model directory has none."""


def vision_spec(config: ModelConfig) -> VisionSpec | None:
    """The VisionSpec of a multimodal model; None for text-only models."""
    if not config.is_multimodal:
        return None
    raw = config.raw
    vision = raw.get("vision_config") or {}
    if config.family == "llava":
        return _llava_spec(raw, vision)
    return _qwen2_vl_spec(raw, vision, config.family)


def _llava_spec(raw: dict[str, Any], vision: dict[str, Any]) -> VisionSpec:
    image_size, patch = int(vision.get("image_size", 336)), int(vision.get("patch_size", 14))
    siglip = "siglip" in str(vision.get("model_type", ""))
    # CLIP adds a class token, which the "default" feature selection drops again
    tokens = (image_size // patch) ** 2 + (0 if siglip else 1)
    if raw.get("vision_feature_select_strategy", "default") == "default":
        tokens -= 1
    if siglip:
        processor = {"image_processor_type": "SiglipImageProcessor",
                     "size": {"height": image_size, "width": image_size}, "do_center_crop": False,
                     "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": 2}
    else:
        processor = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": image_size},
                     "crop_size": {"height": image_size, "width": image_size}, "do_center_crop": True,
                     "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD), "resample": 3}
    token = raw.get("image_token_index", raw.get("image_token_id", DEFAULT_LLAVA_IMAGE_TOKEN))
    return VisionSpec("llava", int(token), (), "\n", "clip", tokens, processor)


def _qwen2_vl_spec(raw: dict[str, Any], vision: dict[str, Any], family: str) -> VisionSpec:
    ids = {key: int(raw.get(key, default)) for key, default in DEFAULT_QWEN2_VL_TOKENS.items()}
    patch, merge = int(vision.get("patch_size", 14)), int(vision.get("spatial_merge_size", 2))
    processor = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 56 * 56,
                 "max_pixels": 28 * 28 * 1280, "patch_size": patch, "merge_size": merge,
                 "temporal_patch_size": int(vision.get("temporal_patch_size", 2)),
                 "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD), "resample": 3}
    return VisionSpec(family, ids["image_token_id"], (ids["vision_start_token_id"], ids["vision_end_token_id"]),
                      "", "qwen2-vl", 0, processor)

