"""The worker's half of image handling: per EXTEND pass, the image features and M-RoPE positions.

For every request of the pass whose new tokens cover image positions, the image's features come
from a small content-keyed cache or from the model's vision encoder (all missing images of a pass
in one call). A chunked prompt or a prefix match that ends inside an image takes the rows it
needs. Images whose tokens the radix cache already holds are never encoded again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixmesh.engine.mm.mrope import mrope_positions
from radixmesh.wire.images import ImageInput, MultimodalInputs

if TYPE_CHECKING:
    from radixmesh.engine.batch import ScheduleBatch
    from radixmesh.engine.request import Req

FEATURE_CACHE_BYTES = 256 << 20
"""Vision features kept for reuse (chunked prompts, the same image in another context)."""


@dataclass
class ReqImages:
    """A request's images and what the worker derives from them once."""

    inputs: MultimodalInputs
    mrope: np.ndarray | None = None
    """[3, prompt_len] M-RoPE positions (M-RoPE models; computed on first use)."""
    mrope_delta: int = 0
    """Position id minus sequence index of every token after the prompt (<= 0)."""


@dataclass
class MultimodalForward:
    """What an EXTEND pass of a multimodal model needs besides token ids (`ForwardBatch.mm`)."""

    embed_rows: torch.Tensor | None = None
    """[n] int64: packed token rows that take image features."""
    embeds: torch.Tensor | None = None
    """[n, hidden]: their features, in the order of `embed_rows`."""
    mrope_positions: torch.Tensor | None = None
    """[3, num_tokens] int64 M-RoPE positions (M-RoPE models, when a request of the pass has images)."""
    rope_deltas: torch.Tensor | None = None
    """[batch] int64 each request's M-RoPE delta (M-RoPE models)."""
    encoded: list[int] = field(default_factory=list)
    """Content hashes of the images the vision encoder ran on in this pass (stats and tests)."""


class FeatureCache:
    """Vision features by image content hash, least recently used dropped beyond a byte budget."""

    def __init__(self, max_bytes: int = FEATURE_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.num_bytes = 0

    def get(self, key: int) -> torch.Tensor | None:
        value = self.entries.get(key)
        if value is not None:
            self.entries.move_to_end(key)
        return value

    def clear(self) -> None:
        self.entries.clear()
        self.num_bytes = 0

    def put(self, key: int, value: torch.Tensor) -> None:
        if key in self.entries:
            return
        self.entries[key] = value
        self.num_bytes += value.numel() * value.element_size()
        while self.num_bytes > self.max_bytes and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.num_bytes -= old.numel() * old.element_size()


class MultimodalRuntime:
    """Prepares `ForwardBatch.mm` for a multimodal model; owned by the ModelRunner."""

    def __init__(self, model: Any, num_request_rows: int, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        self.merge_size = int((model.config.raw.get("vision_config") or {}).get("spatial_merge_size", 2))
        if self.uses_mrope:
            model.bind_request_rows(num_request_rows)
        self.cache = FeatureCache()
        self.num_images_encoded = 0

    def prepare(self, batch: ScheduleBatch) -> MultimodalForward | None:
        """The pass's image inputs; None for DECODE (and for EXTEND passes without images on models
        without M-RoPE)."""
        if batch.is_decode:
            return None
        out = MultimodalForward()
        self._gather_features(batch, out)
        if self.uses_mrope:
            self._rope(batch, out)
        return out if out.embed_rows is not None or self.uses_mrope else None

    def _gather_features(self, batch: ScheduleBatch, out: MultimodalForward) -> None:
        wanted: list[tuple[ImageInput, int, int, int]] = []  # image, first row in it, rows, packed row
        offset = 0
        for req in batch.reqs:
            start, end = req.kv_len, req.kv_len + req.extend_len
            for image in _images(req):
                lo, hi = max(start, image.offset), min(end, image.end)
                if lo < hi:
                    wanted.append((image, lo - image.offset, hi - lo, offset + lo - start))
            offset += req.extend_len
        if not wanted:
            return
        features = self._features([w[0] for w in wanted], out)
        out.embeds = torch.cat([features[image.content_hash][first:first + n] for image, first, n, _ in wanted])
        rows = [row + i for _, _, n, row in wanted for i in range(n)]
        out.embed_rows = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)

    def _features(self, images: list[ImageInput], out: MultimodalForward) -> dict[int, torch.Tensor]:
        found: dict[int, torch.Tensor] = {}
        missing: dict[int, ImageInput] = {}
        for image in images:
            cached = self.cache.get(image.content_hash)
            if cached is not None:
                found[image.content_hash] = cached
            else:
                missing.setdefault(image.content_hash, image)
        if missing:
            todo = list(missing.values())
            for image, features in zip(todo, self.model.encode_images(todo)):
                assert features.shape[0] == image.num_tokens, (
                    f"the vision encoder gave {features.shape[0]} rows for an image of {image.num_tokens} tokens")
                found[image.content_hash] = features
                self.cache.put(image.content_hash, features)
            out.encoded = [image.content_hash for image in todo]
            self.num_images_encoded += len(todo)
        return found

    def _rope(self, batch: ScheduleBatch, out: MultimodalForward) -> None:
        deltas: list[int] = []
        pieces: list[np.ndarray] = []
        for req in batch.reqs:
            start, end = req.kv_len, req.kv_len + req.extend_len
            state = req.mm
            if state is None:
                deltas.append(0)
                pieces.append(np.broadcast_to(np.arange(start, end, dtype=np.int64), (3, end - start)))
                continue
            prompt_len = len(req.origin_input_ids)
            if state.mrope is None:
                state.mrope, state.mrope_delta = mrope_positions(prompt_len, state.inputs.images, self.merge_size)
            deltas.append(state.mrope_delta)
            inside = state.mrope[:, start:min(end, prompt_len)]
            after = np.arange(max(start, prompt_len), end, dtype=np.int64) + state.mrope_delta
            pieces.append(np.concatenate([inside, np.broadcast_to(after, (3, after.shape[0]))], axis=1))
        out.rope_deltas = torch.tensor(deltas, dtype=torch.int64).to(self.device, non_blocking=True)
        if any(req.mm is not None for req in batch.reqs):
            positions = torch.from_numpy(np.ascontiguousarray(np.concatenate(pieces, axis=1)))
            out.mrope_positions = positions.to(self.device, non_blocking=True)


def _images(req: Req) -> tuple[ImageInput, ...]:
    return req.mm.inputs.images if req.mm is not None else ()


def sampling_prompt_ids(req: Req) -> list[int]:
    """The prompt ids penalties count as seen: without image positions (their pad ids are not tokens)."""
    return req.origin_input_ids if req.mm is None else req.mm.inputs.text_ids(req.origin_input_ids)
