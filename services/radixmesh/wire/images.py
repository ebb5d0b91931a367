"""Preprocessed images inside a prompt, and the token ids that stand for them.

An image occupies `num_tokens` consecutive positions of the prompt. Their token ids are not the
model's placeholder id but *pad ids* drawn from the image's content hash: ids in
[IMAGE_PAD_BASE, 2**32), which no vocabulary uses. The radix cache and the routers' block hashes
key on token ids, so the same image in the same context shares KV across requests and workers,
different images never do, and neither needs to know about images. The model embeds these
positions from its vision encoder instead of its embedding table.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from radixmesh.common.errors import invalid_argument

IMAGE_PAD_BASE = 1 << 31
"""Token ids at or above this are image positions (pad ids); they fit the uint32 of the protobuf contracts."""
_PAD_MASK = IMAGE_PAD_BASE - 1


class ImageInput(msgspec.Struct, frozen=True):
    """One preprocessed image: the vision encoder's input and the prompt positions it fills."""

    content_hash: int
    """64-bit hash of the pixel values, their shape and the patch grid (`image_content_hash`)."""
    offset: int
    """Index of the image's first token in the prompt."""
    num_tokens: int
    """Prompt positions the image fills (the vision encoder's output rows)."""
    pixel_values: bytes
    """float32 little-endian, C order, of shape `pixel_shape`."""
    pixel_shape: tuple[int, ...]
    """[3, height, width] for fixed-size towers (CLIP, SigLIP); [num_patches, patch_dim] for Qwen2-VL."""
    grid_thw: tuple[int, int, int] | None = None
    """Qwen2-VL patch grid (temporal, height, width) before the spatial merge; None for fixed-size towers."""

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    def pixels(self) -> np.ndarray:
        """The pixel values as a float32 array of `pixel_shape` (a copy: writable)."""
        return np.frombuffer(self.pixel_values, dtype="<f4").reshape(self.pixel_shape).copy()


class MultimodalInputs(msgspec.Struct, frozen=True):
    """The images of one prompt, in prompt order."""

    images: tuple[ImageInput, ...]

    def text_ids(self, input_ids: Sequence[int]) -> list[int]:
        """The prompt without its image positions (what penalties count as seen tokens)."""
        return [t for t in input_ids if t < IMAGE_PAD_BASE]


def image_content_hash(pixels: np.ndarray, grid_thw: tuple[int, int, int] | None) -> int:
    """64-bit content key of a preprocessed image: blake2b over its shape, grid and float32 pixels."""
    data = np.ascontiguousarray(pixels, dtype="<f4")
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack(f"<{data.ndim}I", *data.shape))
    h.update(struct.pack("<3I", *(grid_thw or (0, 0, 0))))
    h.update(data.tobytes())
    return int.from_bytes(h.digest(), "little")


def image_pad_ids(content_hash: int, num_tokens: int) -> list[int]:
    """The token ids of an image's positions: 31-bit values from blake2b in counter mode over the
    content hash, offset by IMAGE_PAD_BASE. Distinct per position, so two images whose first ids
    collide still part ways at the next position."""
    key = struct.pack("<Q", content_hash)
    ids: list[int] = []
    counter = 0
    while len(ids) < num_tokens:
        digest = hashlib.blake2b(key + struct.pack("<I", counter), digest_size=32).digest()
        ids.extend(IMAGE_PAD_BASE | (v & _PAD_MASK) for v in struct.unpack("<8I", digest))
        counter += 1
    return ids[:num_tokens]


def check_image_spans(input_ids: Sequence[int], mm: MultimodalInputs, vocab_size: int) -> None:
    """Images in order, inside the prompt, not overlapping, their positions holding exactly their pad
    ids, and every other id in the vocabulary; INVALID_ARGUMENT naming `images` otherwise."""
    prev_end = 0
    for i, image in enumerate(mm.images):
        if image.num_tokens < 1 or image.offset < prev_end or image.end > len(input_ids):
            raise invalid_argument(f"images[{i}]: its {image.num_tokens} tokens at offset {image.offset} do not fit "
                                   f"the {len(input_ids)}-token prompt after the previous image", "images")
        if list(input_ids[image.offset:image.end]) != image_pad_ids(image.content_hash, image.num_tokens):
            raise invalid_argument(f"images[{i}]: the prompt's ids at its positions are not its pad ids", "images")
        expected = int(np.prod(image.pixel_shape)) * 4 if image.pixel_shape else -1
        if len(image.pixel_values) != expected:
            raise invalid_argument(f"images[{i}]: {len(image.pixel_values)} bytes of pixel values for shape "
                                   f"{list(image.pixel_shape)}", "images")
        prev_end = image.end
    text = mm.text_ids(input_ids)
    if len(text) != len(input_ids) - sum(image.num_tokens for image in mm.images):
        raise invalid_argument("the prompt has image pad ids outside its images' positions", "input_ids")
    if text and (min(text) < 0 or max(text) >= vocab_size):
        raise invalid_argument(f"input_ids must be in [0, {vocab_size})", "input_ids")


def masked_text_ids(input_ids: Sequence[int]) -> list[int]:
    """The prompt with every image position replaced by id 0 (same length; for checks of text ids)."""
    return [t if t < IMAGE_PAD_BASE else 0 for t in input_ids]


@dataclass(frozen=True)
class ImageSource:
    """One image of a request, before it is read."""

    part: str
    """Where it sits in the request, for errors: `messages[0].content[1].image_url`, `image_data[2]`."""
    url: str | None = None
    """A data: URL, an http(s) URL or a bare base64 string."""
    data: bytes | None = None
    """The encoded image file itself (PNG, JPEG, WebP, ...)."""
