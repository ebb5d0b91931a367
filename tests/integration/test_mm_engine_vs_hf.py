"""Multimodal engine on the CPU against Hugging Face transformers: tiny random-weight LLaVA, Qwen2-VL and
Qwen2.5-VL checkpoints (built and saved here), one and two images; a repeated image reports cached tokens."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from radixmesh.engine.engine import Engine
from tests import mm_factory as mf

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_NEW = 10
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
PNGS = [mf.image_png(1, 100, 70), mf.image_png(2, 60, 90), mf.image_png(3, 84, 84)]
LLAVA_IMAGE = "<image>\n"
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("mm")
    tok = mf.tokenizer_dir(mf.default_tokenizer_source(), base / "tok")
    return {"llava": mf.llava_dir(tok, base / "llava"), "qwen2_vl": mf.qwen2_vl_dir(tok, base / "qwen2_vl"),
            "qwen2_5_vl": mf.qwen2_5_vl_dir(tok, base / "qwen2_5_vl")}


@pytest.fixture(scope="module")
def engines(models: dict[str, Path]) -> Iterator[dict[str, Engine]]:
    """One engine per architecture, started side by side."""
    configs = {"llava": dict(model=str(models["llava"]), max_total_tokens=4096),
               # prefill chunks of 8 tokens: an image's tokens are split across passes
               "qwen2_vl": dict(model=str(models["qwen2_vl"]), max_total_tokens=4096, chunked_prefill_size=8),
               "qwen2_5_vl": dict(model=str(models["qwen2_5_vl"]), max_total_tokens=2048)}
    with ThreadPoolExecutor(len(configs)) as pool:
        futures = {name: pool.submit(Engine, device="cpu", **kwargs) for name, kwargs in configs.items()}
    with contextlib.ExitStack() as stack:
        for future in futures.values():  # every engine that started is shut down, even if another failed
            if future.exception() is None:
                stack.enter_context(future.result())
        yield {name: future.result() for name, future in futures.items()}


@pytest.fixture(scope="module")
def llava(engines: dict[str, Engine]) -> Engine:
    return engines["llava"]


@pytest.fixture(scope="module")
def qwen(engines: dict[str, Engine]) -> Engine:
    return engines["qwen2_vl"]


def _prompt(image: str, n: int) -> str:
    return "USER: " + image * n + "What is in the picture? ASSISTANT:"


@pytest.mark.parametrize("num_images", [1, 2])
def test_llava_greedy_tokens_equal_hugging_face(llava: Engine, models: dict[str, Path], num_images: int) -> None:
    prompt = _prompt(LLAVA_IMAGE, num_images)
    expected = mf.hf_llava_greedy(models["llava"], prompt, PNGS[:num_images], MAX_NEW)
    result = llava.generate(prompt, GREEDY, image_data=[mf.data_url(p) for p in PNGS[:num_images]])
    assert isinstance(result, dict)
    assert result["output_ids"] == expected


@pytest.mark.parametrize("num_images", [1, 2])
def test_qwen2_vl_greedy_tokens_equal_hugging_face(qwen: Engine, models: dict[str, Path], num_images: int) -> None:
    prompt = _prompt(QWEN_IMAGE, num_images)
    expected = mf.hf_qwen2_vl_greedy(models["qwen2_vl"], prompt, PNGS[:num_images], MAX_NEW)
    result = qwen.generate(prompt, GREEDY, image_data=[mf.data_url(p) for p in PNGS[:num_images]])
    assert isinstance(result, dict)
    assert result["output_ids"] == expected


@pytest.mark.parametrize("num_images", [1, 2])
def test_qwen2_5_vl_greedy_tokens_equal_hugging_face(engines: dict[str, Engine], models: dict[str, Path],
                                                     num_images: int) -> None:
    """Window attention in the vision encoder: the 140x100 image spans two windows of 2x2 merged tokens."""
    pngs = [mf.image_png(4, 140, 100), PNGS[1]][:num_images]
    prompt = _prompt(QWEN_IMAGE, num_images)
    expected = mf.hf_qwen2_vl_greedy(models["qwen2_5_vl"], prompt, pngs, MAX_NEW)
    engine = engines["qwen2_5_vl"]
    assert engine.flush_cache()  # every image computed, none served from an earlier case's cache
    result = engine.generate(prompt, GREEDY, image_data=[mf.data_url(p) for p in pngs])
    assert isinstance(result, dict)
    assert result["output_ids"] == expected


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_repeated_image_is_cached_and_another_image_is_not(arch: str, llava: Engine, qwen: Engine) -> None:
    engine, image = (llava, LLAVA_IMAGE) if arch == "llava" else (qwen, QWEN_IMAGE)
    assert engine.flush_cache()
    prompt = "SYSTEM: describe images well. USER: " + image + "What is it? ASSISTANT:"
    first = engine.generate(prompt, GREEDY, image_data=mf.data_url(PNGS[2]))
    again = engine.generate(prompt, GREEDY, image_data=mf.data_url(PNGS[2]))
    other = engine.generate(prompt, GREEDY, image_data=mf.data_url(PNGS[0]))
    assert isinstance(first, dict) and isinstance(again, dict) and isinstance(other, dict)
    prompt_len = first["meta_info"]["prompt_tokens"]
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == prompt_len - 1  # everything but the token that is recomputed
    assert again["output_ids"] == first["output_ids"]
    _, mm = engine.prepare_prompt(prompt, mf.data_url(PNGS[0]))
    assert mm is not None
    # the other image shares only the text before it; its own tokens and everything after are computed
    assert other["meta_info"]["cached_tokens"] == mm.images[0].offset > 0


def test_n_branches_share_the_image_prompt(llava: Engine, models: dict[str, Path]) -> None:
    prompt = _prompt(LLAVA_IMAGE, 1)
    expected = mf.hf_llava_greedy(models["llava"], prompt, PNGS[1:2], MAX_NEW)
    results = llava.generate(prompt, {**GREEDY, "n": 2}, image_data=mf.data_url(PNGS[1]))
    assert isinstance(results, list) and [r["output_ids"] for r in results] == [expected, expected]


def test_dummy_weights_of_a_multimodal_directory_generate(models: dict[str, Path]) -> None:
    with Engine(str(models["qwen2_vl"]), load_format="dummy", device="cpu", max_total_tokens=2048) as engine:
        result = engine.generate(_prompt(QWEN_IMAGE, 1), {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
                                 image_data=mf.data_url(PNGS[0]))
    assert isinstance(result, dict) and len(result["output_ids"]) == 3


def test_image_prompts_decode_without_speculation_text_prompts_with_it(models: dict[str, Path]) -> None:
    """An engine with n-gram speculation: the image request's tokens still equal Hugging Face's and its
    pad ids never reach the n-gram index (no lookup), while a text prompt in the same engine is looked up
    at every decode step. The back-off is off: it decides by measured step times, which vary by machine."""
    prompt = _prompt(LLAVA_IMAGE, 1)
    expected = mf.hf_llava_greedy(models["llava"], prompt, PNGS[:1], MAX_NEW)
    with Engine(str(models["llava"]), device="cpu", max_total_tokens=4096, speculative_algorithm="ngram",
                disable_speculative_backoff=True) as engine:
        result = engine.generate(prompt, GREEDY, image_data=[mf.data_url(PNGS[0])])
        assert isinstance(result, dict) and result["output_ids"] == expected
        assert engine.get_server_info()["spec_ngram_lookups"] == 0
        engine.generate("a b c d a b c d a b c d a b c d", GREEDY)
        assert engine.get_server_info()["spec_ngram_lookups"] > 0
