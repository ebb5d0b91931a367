"""Greedy output of the engine equals Hugging Face transformers token for token (SmolLM2-135M)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import torch

from radixmesh import Engine

pytestmark = [pytest.mark.slow, pytest.mark.integration]

MAX_NEW = 24
RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
CHAT_PROMPTS = ["What is the capital of France?", "Name three colors."]


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    ids = [tok.encode(p) for p in RAW_PROMPTS]
    for text in CHAT_PROMPTS:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
        ids.append(tok.encode(chat, add_special_tokens=False))
    return ids


@pytest.fixture(scope="module")
def engines(prompts) -> Iterator[dict[str, Future[Engine]]]:
    """The engine of each test below that needs its own settings, all starting in the background (they load
    while the reference answers are computed); a test closes its engine when it is done."""
    need = max(len(p) for p in prompts) + MAX_NEW + 2
    configs: dict[str, dict[str, Any]] = {
        "chunked": dict(chunked_prefill_size=7),
        # Admission reserves almost nothing for decode, so decode must run out of KV and retract. The pool
        # is tight because the two chat prompts share their template's ~30-token system prompt, cached once.
        "retraction": dict(max_total_tokens=need + 20, chunked_prefill_size=-1, init_new_token_ratio=0.05,
                           min_new_token_ratio=0.05),
        "overlap": dict(overlap_schedule="on", chunked_prefill_size=16),
        "radix-off": dict(disable_radix_cache=True, schedule_policy="fcfs"),
    }
    pool = ThreadPoolExecutor(len(configs))
    futures = {name: pool.submit(Engine, **kwargs) for name, kwargs in configs.items()}
    pool.shutdown(wait=False)
    yield futures
    for future in futures.values():  # those a failed test left open
        if future.exception() is None:
            future.result().shutdown()


@pytest.fixture(scope="module")
def reference(default_model_dir, prompts, engines):
    """HF's greedy tokens for every prompt (computed while `engines` start)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    model.eval()
    outputs = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        outputs.append(out[0, len(ids):].tolist())
    return prompts, outputs


GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW}


def _check(engine: Engine, prompts, expected, batched: bool) -> list[dict]:
    if batched:
        results = engine.generate(prompts, GREEDY)
    else:
        results = [engine.generate(p, GREEDY) for p in prompts]
    for res, want in zip(results, expected):
        assert res["output_ids"] == want
    return results


def _flush(engine: Engine) -> None:
    deadline = time.monotonic() + 60
    while not engine.flush_cache():  # refused while the scheduler still has work
        assert time.monotonic() < deadline, "the cache could not be flushed"
        time.sleep(0.05)


def test_one_at_a_time_and_batched_match_hf(reference, default_engine):
    prompts, expected = reference
    engine = default_engine  # shared: start from an empty prefix cache
    _flush(engine)
    _check(engine, prompts, expected, batched=False)
    _flush(engine)
    _check(engine, prompts, expected, batched=True)


def test_prefix_cache_hit_matches_hf(reference, default_engine):
    prompts, expected = reference
    engine = default_engine
    _flush(engine)
    first = _check(engine, prompts[:1], expected[:1], batched=False)[0]
    assert first["meta_info"]["cached_tokens"] == 0
    chat = _check(engine, prompts[3:4], expected[3:4], batched=False)[0]
    assert chat["meta_info"]["cached_tokens"] == 0
    again = _check(engine, prompts, expected, batched=True)
    assert again[0]["meta_info"]["cached_tokens"] == len(prompts[0]) - 1
    assert again[3]["meta_info"]["cached_tokens"] == len(prompts[3]) - 1
    # the other chat prompt shares the system prompt with the cached one
    assert again[4]["meta_info"]["cached_tokens"] > 10


def test_chunked_prefill_matches_hf(reference, engines):
    prompts, expected = reference
    with engines["chunked"].result() as engine:
        _check(engine, prompts, expected, batched=True)
        _check(engine, prompts, expected, batched=False)


def test_forced_retraction_matches_hf(reference, engines):
    prompts, expected = reference
    with engines["retraction"].result() as engine:
        _check(engine, prompts, expected, batched=True)
        info = engine.get_server_info()
        assert info["num_retractions"] > 0
        assert info["kv_used_tokens"] == 0


def test_overlap_schedule_matches_hf(reference, engines):
    prompts, expected = reference
    with engines["overlap"].result() as engine:
        _check(engine, prompts, expected, batched=True)
        _check(engine, prompts[:2], expected[:2], batched=False)


def test_radix_cache_disabled_matches_hf(reference, engines):
    prompts, expected = reference
    with engines["radix-off"].result() as engine:
        results = _check(engine, prompts, expected, batched=True)
        assert all(r["meta_info"]["cached_tokens"] == 0 for r in results)
