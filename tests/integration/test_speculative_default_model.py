"""Speculative decoding on the real default model (CPU): greedy output identical to plain decoding.

Many prompts, batched: copy-heavy ones (rewrite, extend, edit code) where n-gram drafts are often
accepted, and open questions where they mostly are not. `draft` uses a random-weight draft of the
default model's shape (drafts rejected: the machinery must change nothing) and the default model
itself as its own draft (every draft accepted).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from radixmesh.engine.config import EngineConfig
from radixmesh.engine.hf_tokenizer import encode_chat, load_tokenizer
from radixmesh.engine.loader import prepare_model
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.core import Scheduler
from radixmesh.wire.sampling import SamplingParams
from tests.unit.scheduler_factory import Collector, assert_no_leak, run_until_idle

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PASSAGE = ("The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed "
           "the spiral stairs, trimmed the wick and wound the clockwork that turned the great lens.")
CODE = ("def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal += "
        "item.price * item.quantity\n    return subtotal * (1 + tax_rate)\n")
QUESTIONS = [
    f"Repeat this passage exactly:\n\n{PASSAGE}",
    f"Rewrite this passage in the present tense:\n\n{PASSAGE}",
    f"Continue this story for a few sentences:\n\n{PASSAGE}",
    f"Rename the function total_price to order_total in this code:\n\n{CODE}",
    f"Add a docstring to this function:\n\n{CODE}",
    f"Add type hints to this function:\n\n{CODE}",
    "List the days of the week, one per line.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a radix tree is in two sentences.",
    "Count from 1 to 20 separated by commas.",
    "Give three tips for learning to cook.",
]
MAX_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Any) -> Any:
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    return [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


def _scheduler(tokenizer: Any, **overrides: Any) -> tuple[Scheduler, Collector]:
    config = EngineConfig(device="cpu", max_total_tokens=16384, **overrides).resolve()
    runner = ModelRunner(config, prepare_model(None))
    col = Collector()
    return Scheduler(config, runner, tokenizer, col), col


def _generate(sched: Scheduler, col: Collector, prompts: list[list[int]], max_new_tokens: int = MAX_NEW_TOKENS,
              **params: Any) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        sched.add_request(Req(rid=f"r{i}", origin_input_ids=list(ids),
                              params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **params)))
    run_until_idle(sched)
    assert not col.errors, col.errors
    assert_no_leak(sched)
    return [col.tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def plain_outputs(tokenizer: Any, prompts: list[list[int]]) -> list[list[int]]:
    sched, col = _scheduler(tokenizer)
    return _generate(sched, col, prompts)


def _spec_stats(sched: Scheduler) -> dict[str, Any]:
    return {k: v for k, v in sched.stats().items() if k.startswith("spec_")}


def test_ngram_greedy_is_identical(tokenizer: Any, prompts: list[list[int]], plain_outputs: list[list[int]]) -> None:
    sched, col = _scheduler(tokenizer, speculative_algorithm="ngram")
    assert _generate(sched, col, prompts) == plain_outputs
    stats = _spec_stats(sched)
    print("ngram:", json.dumps(stats))
    assert stats["spec_num_accepted_tokens"] > 20 and stats["spec_accept_length"] > 1.5


@pytest.mark.parametrize("draft", ["random-weights", "same-model"])
def test_draft_model_greedy_is_identical(tokenizer: Any, prompts: list[list[int]], plain_outputs: list[list[int]],
                                         draft: str) -> None:
    model, load_format = ("smollm2-135m", "dummy") if draft == "random-weights" else ("smollm2-135m-instruct", "auto")
    # Two drafts a step suffice where every draft is rejected (each costs a pass of a draft as large as the
    # target); four where they are accepted.
    num_drafts = 2 if draft == "random-weights" else 4
    sched, col = _scheduler(tokenizer, speculative_algorithm="draft", speculative_draft_model=model,
                            speculative_draft_load_format=load_format, disable_speculative_backoff=True,
                            speculative_num_draft_tokens=num_drafts)
    assert _generate(sched, col, prompts) == plain_outputs
    stats = _spec_stats(sched)
    print(f"draft {draft}:", json.dumps(stats))
    if draft == "same-model":
        assert stats["spec_accept_rate"] > 0.95
    else:
        assert stats["spec_accept_rate"] < 0.2


def test_ngram_with_a_json_schema_and_logprobs(tokenizer: Any, prompts: list[list[int]]) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"]}
    params = dict(json_schema=json.dumps(schema), logprobs=True)
    ask = encode_chat(tokenizer, [{"role": "user", "content": "Give the capital of France as JSON with keys city "
                                                              "and country, then repeat it."}])
    outputs = []
    for overrides in ({}, {"speculative_algorithm": "ngram"}):
        sched, col = _scheduler(tokenizer, **overrides)
        outputs.append(_generate(sched, col, [ask, prompts[0]], max_new_tokens=64, **params))
    assert outputs[0] == outputs[1]
    text = tokenizer.decode(outputs[1][0], skip_special_tokens=True)
    assert set(json.loads(text)) == {"city", "country"}
