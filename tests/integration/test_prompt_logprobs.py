"""Prompt-token log-probs of the engine equal log_softmax of a Hugging Face forward (SmolLM2-135M).

One engine with small prefill chunks, so long prompts are scored chunk by chunk, and the
same prompts asked twice, so the second asks start inside a cached prefix.
"""

from __future__ import annotations

import math

import pytest
import torch

from radixmesh import Engine

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PROMPTS = [
    "The capital of France is Paris, and the capital of Germany is Berlin. The capital of Italy is",
    "def add(a, b):\n    return a + b\n",
    "Hi",
]


@pytest.fixture(scope="module")
def reference(default_model_dir) -> list[tuple[list[int], list[float | None]]]:
    """(prompt ids, log-prob of each prompt token given the ones before; None for the first)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    out = []
    for text in PROMPTS:
        ids = tok.encode(text)
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        out.append((ids, [None] + [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]))
    return out


@pytest.fixture(scope="module")
def engine():
    with Engine(chunked_prefill_size=8) as eng:
        yield eng


def _ask(engine: Engine, ids: list[int], start: int, top: int = 0) -> dict:
    result = engine.generate(ids, {"max_new_tokens": 1, "temperature": 0, "logprob_start_len": start,
                                   "top_logprobs": top})
    assert isinstance(result, dict)
    meta: dict = result["meta_info"]
    return meta


def _assert_matches(got: list, want: list[float | None], ids: list[int]) -> None:
    assert [token for _, token in got] == ids
    for (value, _), ref in zip(got, want):
        if ref is None:
            assert value is None
        else:
            assert math.isclose(value, ref, abs_tol=2e-3), (value, ref)


def test_whole_prompt_matches_hf(engine: Engine, reference) -> None:
    engine.flush_cache()
    for ids, want in reference:
        meta = _ask(engine, ids, 0)
        assert meta["cached_tokens"] == 0
        _assert_matches(meta["input_token_logprobs"], want, ids)


def test_start_inside_a_cached_prefix_recomputes_from_there(engine: Engine, reference) -> None:
    ids, want = reference[0]
    _ask(engine, ids, 0)  # the whole prompt is cached now
    for start in (1, 9, len(ids) - 1):
        meta = _ask(engine, ids, start)
        assert meta["cached_tokens"] == start - 1
        _assert_matches(meta["input_token_logprobs"], want[start:], ids[start:])


def test_top_logprobs_of_prompt_positions(engine: Engine, reference) -> None:
    ids, want = reference[1]
    meta = _ask(engine, ids, 0, top=3)
    top = meta["input_top_logprobs"]
    assert top[0] is None and len(top) == len(ids)
    for row, ref in zip(top[1:], want[1:]):
        assert len(row) == 3 and row[0][1] >= row[1][1] >= row[2][1]
        assert ref is not None and ref <= row[0][1] + 2e-3


def test_without_start_no_prompt_logprobs(engine: Engine, reference) -> None:
    ids, _ = reference[2]
    meta = _ask(engine, ids, -1)
    assert "input_token_logprobs" not in meta
