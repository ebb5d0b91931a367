"""Image preprocessing equals Hugging Face's PIL processors; pad ids, content hashes, M-RoPE positions."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.mm.mrope import mrope_positions
from radixmesh.engine.mm.processors import ClipImageProcessor, Qwen2VLImageProcessor, smart_resize
from radixmesh.wire.block_hash import block_hashes
from radixmesh.wire.images import (
    IMAGE_PAD_BASE,
    ImageInput,
    MultimodalInputs,
    check_image_spans,
    image_content_hash,
    image_pad_ids,
)


def _image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    channels = 4 if mode == "RGBA" else 3
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels, mode=mode)


@pytest.mark.parametrize("size", [(40, 30), (30, 61), (336, 336), (500, 200)])
def test_clip_processor_equals_hugging_face(size: tuple[int, int]) -> None:
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    hf = CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    ours = ClipImageProcessor(hf.to_dict(), 576)
    image = _image(*size)
    expected = hf(images=[image], return_tensors="np")["pixel_values"][0]
    got = ours.preprocess(image).pixels
    assert got.shape == expected.shape == (3, 336, 336)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


def test_llava_pad_to_square_equals_hugging_face() -> None:
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    hf = LlavaImageProcessorPil(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}, do_pad=True)
    cfg = {**hf.to_dict(), "do_pad": True}
    image = _image(300, 120, seed=3)
    expected = hf(images=[image], return_tensors="np")["pixel_values"][0]
    np.testing.assert_allclose(ClipImageProcessor(cfg, 256).preprocess(image).pixels, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("size", [(40, 30), (100, 70), (20, 13), (1000, 300), (28, 28)])
def test_qwen2_vl_processor_equals_hugging_face(size: tuple[int, int]) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 20)
    ours = Qwen2VLImageProcessor(hf.to_dict())
    image = _image(*size, seed=size[0])
    expected = hf(images=[image], return_tensors="np")
    got = ours.preprocess(image)
    assert got.grid_thw == tuple(int(x) for x in expected["image_grid_thw"][0])
    assert got.num_tokens == got.grid_thw[1] * got.grid_thw[2] // 4
    np.testing.assert_allclose(got.pixels, expected["pixel_values"], rtol=0, atol=1e-6)


def test_smart_resize_keeps_bounds_and_refuses_extreme_aspect_ratios() -> None:
    h, w = smart_resize(1000, 3000, 28, 56 * 56, 28 * 28 * 1280)
    assert h % 28 == w % 28 == 0 and h * w <= 28 * 28 * 1280 and abs(w / h - 3) < 0.2
    with pytest.raises(RadixMeshError, match="aspect ratio"):
        smart_resize(10, 2500, 28, 56 * 56, 28 * 28 * 1280)


def test_pad_ids_are_out_of_any_vocabulary_distinct_and_keyed_by_content() -> None:
    ids = image_pad_ids(12345, 577)
    assert len(ids) == 577 and len(set(ids)) == 577
    assert all(IMAGE_PAD_BASE <= t < 2**32 for t in ids)
    assert image_pad_ids(12345, 577) == ids
    assert image_pad_ids(12345, 5) == ids[:5]
    other = image_pad_ids(12346, 577)
    assert not set(other) & set(ids)


def test_content_hash_changes_with_any_pixel_and_with_the_grid() -> None:
    pixels = np.random.default_rng(0).standard_normal((3, 8, 8)).astype(np.float32)
    base = image_content_hash(pixels, None)
    assert image_content_hash(pixels.copy(), None) == base
    changed = pixels.copy()
    changed[1, 2, 3] += 1e-3
    assert image_content_hash(changed, None) != base
    assert image_content_hash(pixels, (1, 2, 2)) != base


def _placed(ids_before: list[int], content_hash: int, n: int, after: list[int]) -> tuple[list[int], ImageInput]:
    pixels = np.zeros((3, 2, 2), np.float32)
    image = ImageInput(content_hash, len(ids_before), n, pixels.tobytes(), (3, 2, 2))
    return [*ids_before, *image_pad_ids(content_hash, n), *after], image


def test_block_hashes_key_image_tokens_by_content() -> None:
    """The routers' block chain: the same image in the same context gives the same keys, another image
    gives other keys from the block holding its first token on, and the text before it is unaffected."""
    prefix = list(range(100, 120))
    same_a, _ = _placed(prefix, 1, 40, [5, 6, 7])
    same_b, _ = _placed(prefix, 1, 40, [5, 6, 7])
    other, _ = _placed(prefix, 2, 40, [5, 6, 7])
    ha, hb, ho = block_hashes(same_a, 16), block_hashes(same_b, 16), block_hashes(other, 16)
    assert ha == hb
    assert ho[0] == ha[0]  # block 0 is text only
    assert all(x != y for x, y in zip(ho[1:], ha[1:]))  # block 1 holds the image's first tokens


def test_check_image_spans_refuses_bad_placements() -> None:
    ids, image = _placed([1, 2, 3], 7, 4, [9])
    check_image_spans(ids, MultimodalInputs((image,)), vocab_size=100)
    wrong = list(ids)
    wrong[4] = IMAGE_PAD_BASE + 1
    with pytest.raises(RadixMeshError, match="pad ids"):
        check_image_spans(wrong, MultimodalInputs((image,)), vocab_size=100)
    with pytest.raises(RadixMeshError, match="do not fit"):
        check_image_spans(ids[:5], MultimodalInputs((image,)), vocab_size=100)
    with pytest.raises(RadixMeshError, match="input_ids"):
        check_image_spans([*ids, 500], MultimodalInputs((image,)), vocab_size=100)
    with pytest.raises(RadixMeshError, match="outside"):
        check_image_spans([*ids, IMAGE_PAD_BASE], MultimodalInputs((image,)), vocab_size=100)


def test_mrope_positions_equal_hugging_face_rope_index() -> None:
    from transformers import Qwen2VLConfig, Qwen2VLModel

    config = Qwen2VLConfig(text_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                        "num_key_value_heads": 1, "intermediate_size": 32, "vocab_size": 300},
                           vision_config={"depth": 1, "embed_dim": 16, "num_heads": 2, "hidden_size": 32},
                           image_token_id=250, video_token_id=251)
    with torch.device("meta"):
        model = Qwen2VLModel(config)
    grids = [(1, 4, 6), (1, 8, 2)]
    text = [[10, 11, 12], [13, 14], [15, 16, 17, 18]]
    ids: list[int] = []
    images = []
    for i, grid in enumerate(grids):
        ids += text[i]
        n = grid[1] * grid[2] // 4
        images.append(ImageInput(i, len(ids), n, b"", (0,), grid))
        ids += [250] * n
    ids += text[2]
    input_ids = torch.tensor([ids])
    expected, delta = model.get_rope_index(input_ids, (input_ids == 250).int(), torch.tensor(grids))
    ours, our_delta = mrope_positions(len(ids), images, 2)
    np.testing.assert_array_equal(ours, expected[:, 0].numpy())
    assert our_delta == int(delta) < 0


def test_rgba_images_are_composited_on_white() -> None:
    from radixmesh.engine.mm.loading import to_rgb

    image = Image.new("RGBA", (4, 4), (10, 20, 30, 0))  # fully transparent
    assert to_rgb(image).getpixel((0, 0)) == (255, 255, 255)
    buf = io.BytesIO()
    _image(4, 4, mode="RGBA").save(buf, format="PNG")
    assert to_rgb(Image.open(buf)).mode == "RGB"
