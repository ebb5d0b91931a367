"""Image processors: an RGB image -> the vision encoder's input, as the model's processor config says.

Plugins behind a registry (`IMAGE_PROCESSORS`, kebab-case ids). Each reproduces the Hugging Face
processor of its family step for step (PIL bicubic resize of uint8 pixels, rescale in float64 then
float32, normalize in float32), so pixel values match `transformers`' PIL processors.

- `clip`: CLIP / LLaVA / SigLIP: (pad to square,) resize, center crop, rescale, normalize -> [3, H, W].
- `qwen2-vl`: Qwen2-VL / Qwen2.5-VL: resize to multiples of patch x merge within [min, max] pixels,
  rescale, normalize, cut into patches -> [num_patches, 3 * temporal * patch * patch] and a grid.
"""

from __future__ import annotations

import abc
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from radixmesh.common.errors import invalid_argument, unsupported

if TYPE_CHECKING:
    from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the vision encoder takes it."""

    pixels: np.ndarray
    """float32: [3, H, W] (fixed-size towers) or [num_patches, patch_dim] (Qwen2-VL)."""
    num_tokens: int
    """Prompt positions the image fills."""
    grid_thw: tuple[int, int, int] | None = None
    """Qwen2-VL patch grid (t, h, w) before the spatial merge."""


class ImageProcessor(abc.ABC):
    """Turns one RGB image into a `ProcessedImage`; deterministic (equal images give equal pixels)."""

    @abc.abstractmethod
    def preprocess(self, image: Image.Image) -> ProcessedImage: ...


def _normalized(arr: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [3, H, W]: rescale and normalize as the config says."""
    x = arr.astype(np.float32)
    if cfg.get("do_rescale", True):
        x = (arr.astype(np.float64) * float(cfg.get("rescale_factor", 1 / 255))).astype(np.float32)
    if cfg.get("do_normalize", True):
        mean = np.asarray(cfg.get("image_mean", CLIP_MEAN), dtype=np.float32)
        std = np.asarray(cfg.get("image_std", CLIP_STD), dtype=np.float32)
        x = (x - mean) / std
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def _resize(image: Image.Image, height: int, width: int, resample: int) -> np.ndarray:
    return np.asarray(image.resize((width, height), resample=resample), dtype=np.uint8)


class ClipImageProcessor(ImageProcessor):
    """CLIPImageProcessor / LlavaImageProcessor / SiglipImageProcessor."""

    def __init__(self, cfg: dict[str, Any], num_tokens: int) -> None:
        self.cfg = cfg
        self.num_tokens = num_tokens
        self.size: dict[str, int] = dict(cfg.get("size") or {"shortest_edge": 224})
        crop = cfg.get("crop_size") or {"height": 224, "width": 224}
        self.crop = (int(crop["height"]), int(crop["width"])) if isinstance(crop, dict) else (int(crop), int(crop))
        self.resample = int(cfg.get("resample", _BICUBIC))

    def preprocess(self, image: Image.Image) -> ProcessedImage:
        cfg = self.cfg
        if cfg.get("do_pad"):
            image = _pad_to_square(image, cfg.get("image_mean", CLIP_MEAN))
        arr = np.asarray(image, dtype=np.uint8)
        if cfg.get("do_resize", True):
            height, width = self._target_size(image.height, image.width)
            arr = _resize(image, height, width, self.resample)
        if cfg.get("do_center_crop", False):
            arr = _center_crop(arr, *self.crop)
        return ProcessedImage(_normalized(arr, cfg), self.num_tokens)

    def _target_size(self, height: int, width: int) -> tuple[int, int]:
        size = self.size
        if "shortest_edge" in size:
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = int(size["shortest_edge"]), int(int(size["shortest_edge"]) * long / short)
            return (new_long, new_short) if width <= height else (new_short, new_long)
        if "height" in size and "width" in size:
            return int(size["height"]), int(size["width"])
        raise unsupported(f"image processor size {size} is not supported (shortest_edge, or height and width)")


def _pad_to_square(image: Image.Image, mean: Any) -> Image.Image:
    from PIL import Image

    if image.width == image.height:
        return image
    side = max(image.width, image.height)
    color = tuple(int(m * 255) for m in mean)
    canvas = Image.new("RGB", (side, side), color)
    canvas.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
    return canvas


def _center_crop(arr: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, C] cropped around the center, zero-padded first where the image is smaller (as HF does)."""
    h, w = arr.shape[:2]
    if h < height or w < width:
        new_h, new_w = max(h, height), max(w, width)
        padded = np.zeros((new_h, new_w, arr.shape[2]), dtype=arr.dtype)
        top, left = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
        padded[top:top + h, left:left + w] = arr
        arr, h, w = padded, new_h, new_w
    top, left = (h - height) // 2, (w - width) // 2
    return arr[top:top + height, left:left + width]


class Qwen2VLImageProcessor(ImageProcessor):
    """Qwen2VLImageProcessor: dynamic resolution, patches of patch_size, merged merge_size x merge_size."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        size = cfg.get("size") or {}
        self.min_pixels = int(cfg.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 56 * 56)
        self.max_pixels = int(cfg.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
                              or 28 * 28 * 1280)
        self.patch = int(cfg.get("patch_size", 14))
        self.temporal = int(cfg.get("temporal_patch_size", 2))
        self.merge = int(cfg.get("merge_size", 2))
        self.resample = int(cfg.get("resample", _BICUBIC))

    def preprocess(self, image: Image.Image) -> ProcessedImage:
        height, width = smart_resize(image.height, image.width, self.patch * self.merge, self.min_pixels,
                                     self.max_pixels)
        x = _normalized(_resize(image, height, width, self.resample), self.cfg)  # [C, H, W]
        c, p, m, t = x.shape[0], self.patch, self.merge, self.temporal
        grid_h, grid_w = height // p, width // p
        # [C, H, W] -> patches in merge-block order: [gh/m, gw/m, m, m, C, P, P], repeated over t frames
        blocks = x.reshape(c, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
        pixels = np.ascontiguousarray(frames.reshape(grid_h * grid_w, c * t * p * p), dtype=np.float32)
        return ProcessedImage(pixels, grid_h * grid_w // (m * m), (1, grid_h, grid_w))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width): multiples of `factor`, area within [min_pixels, max_pixels], aspect ratio kept."""
    if max(height, width) / min(height, width) > 200:
        raise invalid_argument(f"the image's aspect ratio {max(height, width) / min(height, width):.0f}:1 is above "
                               "200:1", "image")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


IMAGE_PROCESSORS: dict[str, Callable[[dict[str, Any], int], ImageProcessor]] = {
    "clip": ClipImageProcessor,
    "qwen2-vl": lambda cfg, _num_tokens: Qwen2VLImageProcessor(cfg),
}
"""Processor id -> factory(processor config, tokens per image of fixed-size towers)."""

_PROCESSOR_TYPES = {"CLIPImageProcessor": "clip", "LlavaImageProcessor": "clip", "SiglipImageProcessor": "clip",
                    "Qwen2VLImageProcessor": "qwen2-vl"}
"""Hugging Face `image_processor_type` (without its Fast / Pil suffix) -> processor id."""


def processor_id_of(cfg: dict[str, Any], default: str) -> str:
    """The processor id a processor config names, else the model family's `default`."""
    kind = str(cfg.get("image_processor_type") or "")
    for suffix in ("Fast", "Pil"):
        kind = kind.removesuffix(suffix)
    return _PROCESSOR_TYPES.get(kind, default)


def read_processor_config(*dirs: Path | None) -> dict[str, Any] | None:
    """The image processor section of the first `preprocessor_config.json` (or `processor_config.json`
    with an `image_processor` entry) found in `dirs`; None when there is none."""
    for directory in dirs:
        if directory is None:
            continue
        for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
            path = Path(directory) / name
            if not path.is_file():
                continue
            try:
                data = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise invalid_argument(f"corrupt {path}: {exc}") from None
            section = data.get(key) if key else data
            if isinstance(section, dict):
                return section
    return None
