"""A burst of requests sharing an uncached prefix computes it once (real default model, CPU)."""

from __future__ import annotations

import time

import pytest

from radixmesh import Engine

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PREFIX_LEN = 256
NUM_REQUESTS = 8
PARAMS = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def _flush(engine: Engine) -> None:
    deadline = time.monotonic() + 60
    while not engine.flush_cache():  # refused while the scheduler still has work
        assert time.monotonic() < deadline, "the cache could not be flushed"
        time.sleep(0.05)


def test_burst_with_a_shared_prefix_reuses_it(default_engine: Engine) -> None:
    engine = default_engine
    text = " ".join(f"Rule {i}: answer briefly, politely and only about the topic asked." for i in range(60))
    prefix = engine.encode(text)[:PREFIX_LEN]
    assert len(prefix) == PREFIX_LEN
    prompts = [prefix + engine.encode(f" Question {i}: what is {i} plus {i}?") for i in range(NUM_REQUESTS)]
    _flush(engine)
    burst = engine.generate(prompts, PARAMS)
    assert isinstance(burst, list)
    cached = [r["meta_info"]["cached_tokens"] for r in burst]
    assert sum(cached) >= 0.9 * (NUM_REQUESTS - 1) * PREFIX_LEN, cached
    for prompt, result in zip(prompts, burst):
        _flush(engine)
        alone = engine.generate(prompt, PARAMS)
        assert isinstance(alone, dict)
        assert alone["meta_info"]["cached_tokens"] == 0
        assert result["output_ids"] == alone["output_ids"]
