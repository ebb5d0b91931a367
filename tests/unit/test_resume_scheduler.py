"""A migrated request: the scheduler continues after output ids generated elsewhere exactly as the whole run.

Each case runs a request to the end once, then again from a cut of its output (`Req.output_ids` set, as a
worker does for GenerateRequest.resume_output_ids) on a fresh scheduler: the new tokens must be the rest of
the whole run's, for greedy and seeded sampling, with penalties, min_new_tokens, logprobs and grammars.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import jsonschema
import pytest

from radixmesh.engine.request import Req
from radixmesh.wire.sampling import SamplingParams

from .scheduler_factory import Collector, assert_no_leak, make_scheduler, run_until_idle, tiny_model_config

PROMPT = [5, 17, 99, 3, 42, 8, 61]


def run(params: SamplingParams, output_ids: list[int] | None = None, prompt: list[int] = PROMPT,
        scheduler: Any = None, **overrides: Any) -> tuple[Req, Collector]:
    sched, col = scheduler or make_scheduler(**overrides)
    req = Req(rid=uuid.uuid4().hex[:8], origin_input_ids=list(prompt), params=params,
              output_ids=list(output_ids or []))
    sched.add_request(req)
    run_until_idle(sched)
    assert_no_leak(sched)
    return req, col


CASES = {
    "greedy": SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_new_tokens=16, temperature=1.0, seed=1234, ignore_eos=True),
    "seeded-top-p-k": SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=20, seed=7,
                                     ignore_eos=True),
    "penalties": SamplingParams(max_new_tokens=16, temperature=1.0, seed=99, frequency_penalty=1.5,
                                presence_penalty=0.7, repetition_penalty=1.3, ignore_eos=True),
    "greedy-penalties": SamplingParams(max_new_tokens=16, temperature=0.0, frequency_penalty=2.0, ignore_eos=True),
}


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_resumed_output_continues_the_whole_run(case: str, overlap: str) -> None:
    params = CASES[case]
    whole, col = run(params, overlap_schedule=overlap)
    full = col.tokens[whole.rid]
    assert len(full) == params.max_new_tokens
    for cut in (1, 7, params.max_new_tokens - 1):
        resumed, rcol = run(params, full[:cut], overlap_schedule=overlap)
        assert rcol.tokens[resumed.rid] == full[cut:], f"cut at {cut}"
        assert rcol.finish[resumed.rid] == "length"
        assert resumed.output_ids == full


def test_penalties_see_the_resumed_tokens_as_output() -> None:
    """Without them counted as output, a strong frequency penalty would repeat what was generated before."""
    params = CASES["greedy-penalties"]
    whole, col = run(params)
    full = col.tokens[whole.rid]
    as_prompt, pcol = run(params, prompt=PROMPT + full[:8])  # the same ids as prompt: penalties do not see them
    resumed, rcol = run(params, full[:8])
    assert rcol.tokens[resumed.rid] == full[8:]
    assert pcol.tokens[as_prompt.rid][: len(full) - 8] != full[8:]


def test_min_new_tokens_counts_the_resumed_tokens() -> None:
    eos = 3
    mc = tiny_model_config(eos_token_ids=(eos,))
    params = SamplingParams(max_new_tokens=12, temperature=0.0, min_new_tokens=5,
                            logit_bias={eos: 100.0})  # EOS wins as soon as it is allowed
    whole, col = run(params, scheduler=make_scheduler(mc))
    full = col.tokens[whole.rid]
    assert len(full) == params.min_new_tokens and full[-1] == eos  # EOS allowed once it makes min_new_tokens
    resumed, rcol = run(params, full[:3], scheduler=make_scheduler(mc))
    assert rcol.tokens[resumed.rid] == full[3:] and rcol.finish[resumed.rid] == "stop"


def test_logprobs_continue_and_counts_cover_the_whole_output() -> None:
    params = SamplingParams(max_new_tokens=10, temperature=0.0, logprobs=True, top_logprobs=2, ignore_eos=True)
    sched, col = make_scheduler()
    outs: list[Any] = []
    sched.emit = lambda batch: (outs.extend(batch), col(batch))
    whole, _ = run(params, scheduler=(sched, col))
    full_logprobs = [lp for out in outs for lp in (out.logprobs or [])]
    sched2, col2 = make_scheduler()
    outs2: list[Any] = []
    sched2.emit = lambda batch: (outs2.extend(batch), col2(batch))
    run(params, col.tokens[whole.rid][:4], scheduler=(sched2, col2))
    resumed_logprobs = [lp for out in outs2 for lp in (out.logprobs or [])]
    assert resumed_logprobs == pytest.approx(full_logprobs[4:], abs=1e-4)
    last = outs2[-1]
    assert last.completion_tokens == 10 and last.prompt_tokens == len(PROMPT)
    assert all(out.cached_tokens <= len(PROMPT) for out in outs2)


def test_resume_reuses_the_cached_prompt() -> None:
    params = CASES["greedy"]
    sched = make_scheduler()
    whole, col = run(params, scheduler=sched)
    resumed, _ = run(params, col.tokens[whole.rid][:5], scheduler=sched)
    assert col.cached[resumed.rid] == len(PROMPT)  # prompt and output were cached; only the prompt counts
    assert col.tokens[resumed.rid] == col.tokens[whole.rid][5:]


# ---- grammars: the new worker's matcher replays the resumed tokens ---------------------------------------
GRAMMAR_VOCAB = 49152
EOS = 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,6}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Any) -> Any:
    from radixmesh.engine.hf_tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)


def grammar_scheduler(tokenizer: Any, **overrides: Any) -> Any:
    return make_scheduler(tiny_model_config(vocab_size=GRAMMAR_VOCAB, eos_token_ids=(EOS,)), tokenizer=tokenizer,
                          **overrides)


@pytest.mark.parametrize("jump_forward", [False, True])
def test_grammar_resume_replays_the_matcher(tokenizer: Any, jump_forward: bool) -> None:
    params = SamplingParams(max_new_tokens=48, temperature=1.0, seed=11, json_schema=json.dumps(SCHEMA))
    whole, col = run(params, scheduler=grammar_scheduler(tokenizer, enable_jump_forward=jump_forward))
    full = col.tokens[whole.rid]
    assert col.finish[whole.rid] == "stop"
    jsonschema.validate(json.loads(tokenizer.decode(full, skip_special_tokens=True)), SCHEMA)
    for cut in (1, len(full) // 2, len(full) - 1):
        sched = grammar_scheduler(tokenizer, enable_jump_forward=jump_forward)
        resumed, rcol = run(params, full[:cut], scheduler=sched)
        assert rcol.tokens[resumed.rid] == full[cut:], f"cut at {cut} of {len(full)}"
        assert rcol.finish[resumed.rid] == "stop"


def test_grammar_refusing_the_resumed_output_fails_the_request(tokenizer: Any) -> None:
    params = SamplingParams(max_new_tokens=16, temperature=0.0, regex="(cat|dog)-[0-9]{2}")
    bad = tokenizer.encode("bird", add_special_tokens=False)
    resumed, col = run(params, bad, scheduler=grammar_scheduler(tokenizer))
    assert col.finish[resumed.rid] == "error"
    assert "refuses resumed output" in col.errors[resumed.rid]
