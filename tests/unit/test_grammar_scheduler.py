"""Grammar requests through the scheduler on a tiny random model with the real tokenizer.

Random weights sampled at temperature 1.0 want anything but JSON, so every valid output
below is the grammar's doing; plain requests batched alongside must be unaffected.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from typing import Any

import jsonschema
import pytest

from radixmesh.engine.grammar.hook import GrammarHook
from radixmesh.engine.grammar.manager import GrammarManager
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.core import Scheduler
from radixmesh.wire.sampling import SamplingParams

from .scheduler_factory import assert_no_leak, make_requests, make_scheduler, run_until_idle, tiny_model_config

VOCAB = 49152
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        # a pattern, not maxLength: xgrammar 0.2's length-bounded strings admit raw control characters
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
}
REGEX = r"(cat|dog)-[0-9]{2,3}"
EBNF = 'root ::= "(" expr ")"\nexpr ::= num | num "+" expr\nnum ::= [1-9]'


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from radixmesh.engine.hf_tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)


def grammar_scheduler(tokenizer: Any, **overrides: Any):
    mc = tiny_model_config(vocab_size=VOCAB, eos_token_ids=(EOS,))
    return make_scheduler(mc, tokenizer=tokenizer, **overrides)


def grammar_manager(sched: Scheduler) -> GrammarManager:
    hook = sched.hooks.get(GrammarHook)
    assert hook is not None
    return hook.manager


def req(seed: int, max_new_tokens: int = 64, **params: Any) -> Req:
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed, **params)
    return Req(rid=uuid.uuid4().hex[:8], origin_input_ids=[5, 17 + seed, 99, 1000 + seed], params=sp)


def text_of(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def expr_parses(text: str) -> bool:
    """The EBNF above: '(' num ('+' num)* ')' with one-digit nums."""
    return re.fullmatch(r"\([1-9](\+[1-9])*\)", text) is not None


@pytest.mark.parametrize("overrides", [{}, {"overlap_schedule": "on"}, {"enable_jump_forward": True},
                                       {"enable_jump_forward": True, "overlap_schedule": "on"}])
def test_grammar_outputs_valid_and_plain_requests_untouched(tokenizer, overrides):
    plain = make_requests(2, seed=3, max_new_tokens=8)
    alone, alone_col = grammar_scheduler(tokenizer)
    for r in make_requests(2, seed=3, max_new_tokens=8):
        alone.add_request(r)
    run_until_idle(alone)

    sched, col = grammar_scheduler(tokenizer, **overrides)
    schema_reqs = [req(i, json_schema=json.dumps(SCHEMA)) for i in range(4)]
    regex_reqs = [req(10 + i, regex=REGEX) for i in range(2)]
    ebnf_reqs = [req(20 + i, ebnf=EBNF) for i in range(2)]
    for r in [*schema_reqs, plain[0], *regex_reqs, *ebnf_reqs, plain[1]]:
        sched.add_request(r)
    run_until_idle(sched)

    for r in schema_reqs:
        assert col.finish[r.rid] == "stop" and col.tokens[r.rid][-1] == EOS
        jsonschema.validate(json.loads(text_of(tokenizer, col.tokens[r.rid])), SCHEMA)
    for r in regex_reqs:
        assert re.fullmatch(REGEX, text_of(tokenizer, col.tokens[r.rid])), text_of(tokenizer, col.tokens[r.rid])
    for r in ebnf_reqs:
        assert expr_parses(text_of(tokenizer, col.tokens[r.rid])), text_of(tokenizer, col.tokens[r.rid])
    assert [col.tokens[r.rid] for r in plain] == list(alone_col.tokens.values())
    stats = sched.stats()
    assert stats["num_grammars_compiled"] == 3  # one per distinct spec, however many requests share it
    assert (stats["num_jump_forwards"] > 0) == bool(overrides.get("enable_jump_forward"))
    assert_no_leak(sched)


def test_jump_forward_runs_fewer_passes_with_the_same_validity(tokenizer):
    schema = {"type": "object", "properties": {
        "customer_identifier_code": {"type": "integer", "minimum": 0, "maximum": 9},
        "delivery_address_is_confirmed": {"type": "boolean"}},
        "required": ["customer_identifier_code", "delivery_address_is_confirmed"]}
    passes = {}
    for jump in (False, True):
        sched, col = grammar_scheduler(tokenizer, enable_jump_forward=jump)
        reqs = [req(i, json_schema=json.dumps(schema)) for i in range(2)]
        for r in reqs:
            sched.add_request(r)
        run_until_idle(sched)
        for r in reqs:
            assert col.finish[r.rid] == "stop"
            jsonschema.validate(json.loads(text_of(tokenizer, col.tokens[r.rid])), schema)
        passes[jump] = sched.stats()["num_forward_passes"]
        assert_no_leak(sched)
    assert passes[True] < passes[False] / 2, passes


def test_max_tokens_mid_structure_is_length(tokenizer):
    sched, col = grammar_scheduler(tokenizer, enable_jump_forward=True)
    r = req(1, max_new_tokens=5, json_schema=json.dumps(SCHEMA))
    sched.add_request(r)
    run_until_idle(sched)
    assert col.finish[r.rid] == "length" and len(col.tokens[r.rid]) == 5
    assert text_of(tokenizer, col.tokens[r.rid]).startswith('{"name": "')
    assert_no_leak(sched)


def test_grammar_termination_stops_even_with_ignore_eos(tokenizer):
    sched, col = grammar_scheduler(tokenizer)
    r = req(2, regex="yes|no", ignore_eos=True)
    sched.add_request(r)
    run_until_idle(sched)
    assert col.finish[r.rid] == "stop"
    assert text_of(tokenizer, col.tokens[r.rid]) in ("yes", "no")


def test_bad_grammar_fails_only_that_request(tokenizer):
    sched, col = grammar_scheduler(tokenizer)
    bad = req(1, regex="a[")  # never validated: the scheduler must still fail it cleanly
    good = req(2, regex="ok")
    sched.add_request(bad)
    sched.add_request(good)
    run_until_idle(sched)
    assert col.finish[bad.rid] == "error" and "regex" in col.errors[bad.rid]
    assert col.finish[good.rid] == "stop"
    assert_no_leak(sched)


def test_compile_timeout_fails_only_that_request(tokenizer, monkeypatch):
    big = {"type": "object", "properties": {
        f"field_{i}": {"type": "object", "properties": {"x": {"type": "string", "pattern": "[a-z]{3,9}"},
                                                        "y": {"type": "array", "items": {"type": "number"}}}}
        for i in range(60)}}
    sched, col = grammar_scheduler(tokenizer, grammar_compile_timeout=0.05)
    # the compilation is held past the timeout: a fast machine must not finish it in time
    release = threading.Event()
    backend = grammar_manager(sched).pool.backend
    compile_now = backend.compile

    def held(spec: Any) -> Any:
        release.wait(30)
        return compile_now(spec)

    monkeypatch.setattr(backend, "compile", held)
    slow = req(1, json_schema=json.dumps(big))
    plain = make_requests(1, seed=4, max_new_tokens=4)[0]
    sched.add_request(slow)
    sched.add_request(plain)
    run_until_idle(sched)
    release.set()
    assert col.finish[slow.rid] == "error" and "did not compile within" in col.errors[slow.rid]
    assert col.finish[plain.rid] == "length"
    assert sched.stats()["num_grammar_compile_timeouts"] == 1
    assert_no_leak(sched)


def test_abort_while_the_grammar_compiles(tokenizer):
    sched, col = grammar_scheduler(tokenizer)
    r = req(1, json_schema=json.dumps(SCHEMA))
    sched.add_request(r)
    assert sched.has_work and grammar_manager(sched).has_compiling
    sched.abort(r.rid)
    assert col.finish[r.rid] == "abort" and not sched.has_work
    assert_no_leak(sched)
