"""Limits on the images a request may carry, checked where images are loaded (the edge)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from radixmesh.common.errors import invalid_argument


@dataclass(frozen=True)
class ImageLimits:
    """What the edge accepts before any image is decoded or fetched."""

    max_images_per_request: int = 16
    """Most images in one request (all messages together); more is a 400."""
    max_image_pixels: int = 4096 * 4096
    """Most pixels (width x height) of one image, read from its header before it is decoded; more is a 400."""
    max_image_bytes: int = 20 << 20
    """Most bytes of one encoded image (after base64 decoding, or downloaded); more is a 400."""
    allow_remote_images: bool = False
    """Fetch http(s) image URLs; off by default (only base64 `data:` URLs and raw base64 are read)."""
    remote_image_timeout_s: float = 10.0
    """Seconds one http(s) image fetch may take in all (connect and body)."""

    def __post_init__(self) -> None:
        if self.max_images_per_request < 0:
            raise invalid_argument("max_images_per_request must be >= 0", "max_images_per_request")
        if self.max_image_pixels < 1:
            raise invalid_argument("max_image_pixels must be >= 1", "max_image_pixels")
        if self.max_image_bytes < 1:
            raise invalid_argument("max_image_bytes must be >= 1", "max_image_bytes")
        if not 0 < self.remote_image_timeout_s <= 600:
            raise invalid_argument("remote_image_timeout_s must be in (0, 600]", "remote_image_timeout_s")


def add_image_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ImageLimits field (kebab-case), as `radixmesh serve` and `radixmesh tokenizer` take them."""
    from radixmesh.engine.args import field_docs

    group = parser.add_argument_group("images")
    docs = field_docs(ImageLimits)
    for field in dataclasses.fields(ImageLimits):
        flag = "--" + field.name.replace("_", "-")
        if field.type in ("bool", bool):
            group.add_argument(flag, action="store_true", help=docs.get(field.name, ""))
        else:
            kind = float if field.type in ("float", float) else int
            group.add_argument(flag, type=kind, default=field.default, help=docs.get(field.name, ""))


def image_limits_from_args(args: argparse.Namespace) -> ImageLimits:
    return ImageLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ImageLimits)
                          if hasattr(args, f.name)})
