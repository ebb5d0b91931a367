"""The worker's half of image handling (engine/mm/runtime.py) over a stand-in vision model: which packed rows of an
EXTEND pass take which image features, encoded once per image and reused by later chunks, and the M-RoPE
positions of a pass."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from radixmesh.engine.attention.base import ForwardMode
from radixmesh.engine.batch import ScheduleBatch
from radixmesh.engine.mm.mrope import mrope_positions
from radixmesh.engine.mm.runtime import FeatureCache, MultimodalRuntime, ReqImages, sampling_prompt_ids
from radixmesh.engine.request import Req
from radixmesh.wire.images import ImageInput, MultimodalInputs, image_pad_ids
from radixmesh.wire.sampling import SamplingParams

HIDDEN = 4


class FakeVision:
    """Encodes image `h` into rows [h*100 + i] (so a row says which image and which position it is)."""

    def __init__(self, uses_mrope: bool = False) -> None:
        self.uses_mrope = uses_mrope
        self.config = SimpleNamespace(raw={"vision_config": {"spatial_merge_size": 2}})
        self.calls: list[list[int]] = []
        self.rows_bound: int | None = None

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        self.calls.append([image.content_hash for image in images])
        return [(image.content_hash * 100 + torch.arange(image.num_tokens, dtype=torch.float32))[:, None]
                .expand(image.num_tokens, HIDDEN).clone() for image in images]

    def bind_request_rows(self, num_rows: int) -> None:
        self.rows_bound = num_rows


def image(content_hash: int, offset: int, num_tokens: int, grid: tuple[int, int, int] | None = None) -> ImageInput:
    return ImageInput(content_hash, offset, num_tokens, b"", (), grid)


def with_images(rid: str, text_before: int, images: list[ImageInput], text_after: int = 2) -> Req:
    """A prompt of text, then each image's pad ids (images given in order, offsets as laid out here)."""
    ids = list(range(1, text_before + 1))
    placed = []
    for img in images:
        placed.append(ImageInput(img.content_hash, len(ids), img.num_tokens, b"", (), img.grid_thw))
        ids += image_pad_ids(img.content_hash, img.num_tokens)
    ids += list(range(50, 50 + text_after))
    return Req(rid=rid, origin_input_ids=ids, params=SamplingParams(max_new_tokens=2),
               mm=ReqImages(MultimodalInputs(tuple(placed))))


def extend(*parts: tuple[Req, int, int]) -> ScheduleBatch:
    """An EXTEND pass of (request, kv_len, extend_len) parts."""
    for r, kv_len, extend_len in parts:
        r.kv_len, r.extend_len = kv_len, extend_len
    reqs = [p[0] for p in parts]
    n = sum(p[2] for p in parts)
    return ScheduleBatch(ForwardMode.EXTEND, reqs, [0] * n, list(range(n)), torch.zeros(n, dtype=torch.int64),
                         [p[1] for p in parts], [p[2] for p in parts], list(range(len(reqs))))


def runtime(uses_mrope: bool = False) -> tuple[MultimodalRuntime, FakeVision]:
    model = FakeVision(uses_mrope)
    return MultimodalRuntime(model, 8, torch.device("cpu")), model


def image_of(rows: torch.Tensor) -> list[int]:
    return [int(v) for v in rows[:, 0]]


def test_decode_and_text_only_passes_need_nothing() -> None:
    rt, _ = runtime()
    text = Req(rid="t", origin_input_ids=[1, 2, 3], params=SamplingParams())
    assert rt.prepare(extend((text, 0, 3))) is None
    decode = extend((text, 3, 1))
    decode.mode = ForwardMode.DECODE
    assert rt.prepare(decode) is None


def test_an_image_in_the_pass_fills_its_packed_rows_with_its_features() -> None:
    rt, model = runtime()
    r = with_images("r", 3, [image(7, 0, 4)])
    out = rt.prepare(extend((r, 0, len(r.origin_input_ids))))
    assert out is not None and out.encoded == [7] and model.calls == [[7]] and rt.num_images_encoded == 1
    assert out.embed_rows is not None and out.embeds is not None
    assert out.embed_rows.tolist() == [3, 4, 5, 6] and image_of(out.embeds) == [700, 701, 702, 703]


def test_a_chunk_takes_the_rows_it_covers_and_the_next_chunk_reuses_the_features() -> None:
    rt, model = runtime()
    r = with_images("r", 2, [image(9, 0, 6)])  # image at prompt positions 2..7
    first = rt.prepare(extend((r, 0, 5)))  # positions 0..4: the image's first 3 rows
    assert first is not None and first.embed_rows.tolist() == [2, 3, 4] and image_of(first.embeds) == [900, 901, 902]
    second = rt.prepare(extend((r, 5, 5)))  # positions 5..9: its last 3 rows, at packed rows 0..2
    assert second is not None and second.embed_rows.tolist() == [0, 1, 2]
    assert image_of(second.embeds) == [903, 904, 905] and second.encoded == [] and model.calls == [[9]]


def test_packed_rows_follow_each_request_and_one_image_is_encoded_once() -> None:
    rt, model = runtime()
    a = with_images("a", 1, [image(5, 0, 2)])
    b = with_images("b", 2, [image(5, 0, 2), image(6, 0, 3)])
    out = rt.prepare(extend((a, 0, len(a.origin_input_ids)), (b, 0, len(b.origin_input_ids))))
    assert out is not None and model.calls == [[5, 6]]  # the shared image once, both missing ones in one call
    a_len = len(a.origin_input_ids)
    assert out.embed_rows.tolist() == [1, 2, a_len + 2, a_len + 3, a_len + 4, a_len + 5, a_len + 6]
    assert image_of(out.embeds) == [500, 501, 500, 501, 600, 601, 602]


def test_a_cached_prefix_ending_inside_an_image_needs_only_its_rest() -> None:
    rt, _ = runtime()
    r = with_images("r", 1, [image(3, 0, 5)])  # image at 1..5
    out = rt.prepare(extend((r, 3, len(r.origin_input_ids) - 3)))  # positions 0..2 came from the cache
    assert out is not None and out.embed_rows.tolist() == [0, 1, 2] and image_of(out.embeds) == [302, 303, 304]


def test_the_feature_cache_keeps_the_most_recent_within_its_budget() -> None:
    cache = FeatureCache(max_bytes=3 * 4 * 4)  # three rows of four float32
    for key in (1, 2):
        cache.put(key, torch.zeros(1, 4) + key)
    cache.get(1)  # 1 is the most recent now
    cache.put(3, torch.zeros(2, 4))  # over budget: 2 goes
    assert list(cache.entries) == [1, 3] and cache.num_bytes == 3 * 16
    cache.put(1, torch.ones(9, 4))  # known: kept as it is
    assert cache.get(1) is not None and cache.get(1).shape == (1, 4)
    cache.clear()
    assert cache.entries == {} and cache.num_bytes == 0


def test_mrope_positions_of_a_pass_and_the_delta_after_the_prompt() -> None:
    rt, model = runtime(uses_mrope=True)
    assert model.rows_bound == 8
    text = Req(rid="t", origin_input_ids=[1, 2, 3], params=SamplingParams())
    assert rt.prepare(extend((text, 0, 3))) is not None  # M-RoPE models always get deltas
    r = with_images("r", 2, [image(4, 0, 4, grid=(1, 4, 4))], text_after=2)  # 2x2 merged patches
    prompt_len = len(r.origin_input_ids)
    out = rt.prepare(extend((text, 3, 1), (r, 0, prompt_len)))
    assert out is not None and out.rope_deltas is not None and out.mrope_positions is not None
    expected, delta = mrope_positions(prompt_len, r.mm.inputs.images, 2)  # type: ignore[union-attr]
    assert out.rope_deltas.tolist() == [0, delta] and delta < 0
    assert out.mrope_positions[:, 0].tolist() == [3, 3, 3]  # the text request's one token: its own index
    assert np.array_equal(out.mrope_positions[:, 1:].numpy(), expected)
    after = rt.prepare(extend((r, prompt_len, 1)))  # the first token after the prompt
    assert after is not None and after.mrope_positions[:, 0].tolist() == [prompt_len + delta] * 3


def test_penalties_see_the_prompts_text_not_its_image_positions() -> None:
    r = with_images("r", 2, [image(8, 0, 3)], text_after=1)
    assert sampling_prompt_ids(r) == [1, 2, 50]
    plain = Req(rid="p", origin_input_ids=[4, 5], params=SamplingParams())
    assert sampling_prompt_ids(plain) == [4, 5]


def test_a_vision_encoder_giving_the_wrong_number_of_rows_is_caught() -> None:
    rt, model = runtime()

    def short(images: list[ImageInput]) -> list[Any]:
        return [torch.zeros(image.num_tokens - 1, HIDDEN) for image in images]

    model.encode_images = short  # type: ignore[method-assign]
    r = with_images("r", 1, [image(2, 0, 3)])
    with pytest.raises(AssertionError, match="gave 2 rows for an image of 3 tokens"):
        rt.prepare(extend((r, 0, len(r.origin_input_ids))))
