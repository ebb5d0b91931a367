"""Property-based fuzzing of the request parsers: whatever arrives, the only failure is the domain error.

Random JSON-ish bodies for the three HTTP request models (OpenAI completions, chat, SGLang /generate),
random bytes, and random proto SamplingParams through the worker's conversion and admission checks.
The profile is derandomized (same examples on every run) and small enough to take a few seconds.
"""

from __future__ import annotations

import contextlib
import json
import math
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.sampling.validation import validate_request
from radixmesh.gateway import openai_convert as conv
from radixmesh.gateway.app import create_app
from radixmesh.gateway.config import GatewayConfig
from radixmesh.gateway.native_api import GenerateRequest
from radixmesh.gateway.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from radixmesh.protocol import sampling_pb2
from radixmesh.wire.convert import sampling_from_proto
from radixmesh.wire.sampling import SamplingParams
from tests.unit.test_bad_input_unit import EngineRulesBackend
from tests.unit.test_gateway_api import CONTEXT_LEN, VOCAB

FUZZ = settings(derandomize=True, max_examples=75, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TRICKY_TEXT = st.sampled_from(["", " ", "\ud800", "caf\udfff", "\x00", "😀", "a" * 3000, '{"$ref": "#"}', "[a-",
                               ".?" * 40, "root ::= (", "$$ANY$$", "user", "system", "wizard", "json_schema", "text"])
TEXT = st.text(max_size=20) | TRICKY_TEXT
NUMBERS = (st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from([0, -1, 1, 2**31, 2**63, 10**12]))
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
JSONISH = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=5)
                       | st.dictionaries(TEXT, inner, max_size=5), max_leaves=20)

COMPLETION_FIELDS = sorted(CompletionRequest.model_fields)
CHAT_FIELDS = sorted(ChatCompletionRequest.model_fields)
NATIVE_FIELDS = sorted(GenerateRequest.model_fields)
NATIVE_SAMPLING_FIELDS = ["max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "n", "stop",
                          "stop_token_ids", "logit_bias", "json_schema", "regex", "ebnf", "seed", "ignore_eos"]
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | JSONISH},
                                optional={"content": TEXT | JSONISH})


def _bodies(fields: list[str], extra: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Objects whose keys are mostly the model's own fields (so validation runs deep) with random values."""
    values = {name: extra.get(name, JSONISH) | JSONISH for name in fields}
    return st.fixed_dictionaries({}, optional=values) | st.dictionaries(TEXT, JSONISH, max_size=4)


COMPLETION_BODIES = _bodies(COMPLETION_FIELDS, {"prompt": TEXT | st.lists(st.integers(-5, 10**6), max_size=8)})
CHAT_BODIES = _bodies(CHAT_FIELDS, {"messages": st.lists(MESSAGE, max_size=3)})
NATIVE_BODIES = _bodies(NATIVE_FIELDS, {
    "text": TEXT, "input_ids": st.lists(st.integers(-5, 10**6), max_size=8),
    "sampling_params": st.fixed_dictionaries({}, optional={name: JSONISH for name in NATIVE_SAMPLING_FIELDS})})


def _only_domain_errors(action: Any) -> None:
    with contextlib.suppress(RadixMeshError):
        action()


def _openai_pipeline(req: CompletionRequest | ChatCompletionRequest) -> None:
    """What the OpenAI handlers do with a parsed request before the backend, on a 64-token context."""
    if isinstance(req, CompletionRequest):
        conv.check_completion_supported(req)
        top = req.logprobs
    else:
        conv.check_chat_supported(req)
        conv.chat_messages(req.messages)
        top = (req.top_logprobs or 0) if req.logprobs else None
    max_new = conv.resolve_max_new_tokens(req.max_tokens, 4, CONTEXT_LEN, 16, "max_tokens", "prompt")
    conv.sampling_params(req, max_new, top).validate(VOCAB)


@FUZZ
@given(COMPLETION_BODIES)
def test_completion_bodies_fail_only_with_the_domain_error(body: dict[str, Any]) -> None:
    _only_domain_errors(lambda: _openai_pipeline(parse_body(json.dumps(body).encode(), CompletionRequest)))


@FUZZ
@given(CHAT_BODIES)
def test_chat_bodies_fail_only_with_the_domain_error(body: dict[str, Any]) -> None:
    _only_domain_errors(lambda: _openai_pipeline(parse_body(json.dumps(body).encode(), ChatCompletionRequest)))


@FUZZ
@given(NATIVE_BODIES)
def test_native_bodies_fail_only_with_the_domain_error(body: dict[str, Any]) -> None:
    _only_domain_errors(lambda: parse_body(json.dumps(body).encode(), GenerateRequest))


@FUZZ
@given(st.binary(max_size=200) | st.sampled_from([b"{", b"[" * 5000, b'{"a": "\xff"}', b"\xef\xbb\xbf{}",
                                                   b'{"prompt": "\\ud800"}', b"null", b"1e999"]))
def test_raw_bytes_fail_only_with_the_domain_error(raw: bytes) -> None:
    for model in (CompletionRequest, ChatCompletionRequest, GenerateRequest):
        _only_domain_errors(lambda model=model: parse_body(raw, model))  # type: ignore[misc]


@pytest.fixture(scope="module")
def http() -> Any:
    with TestClient(create_app(EngineRulesBackend(), GatewayConfig())) as client:
        yield client


@settings(FUZZ, max_examples=40)
@given(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate"]),
       COMPLETION_BODIES | CHAT_BODIES | NATIVE_BODIES)
def test_the_app_never_answers_500(http: TestClient, path: str, body: dict[str, Any]) -> None:
    response = http.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


# ---- proto -> engine parameters -----------------------------------------------------------------------------
UINT32 = st.integers(0, 2**32 - 1)
DOUBLES = st.floats(allow_nan=True, allow_infinity=True)
PROTO_PARAMS = st.builds(
    sampling_pb2.SamplingParams,
    max_new_tokens=UINT32, min_new_tokens=UINT32, temperature=DOUBLES, top_p=DOUBLES,
    top_k=st.integers(-(2**31), 2**31 - 1), min_p=DOUBLES, frequency_penalty=DOUBLES, presence_penalty=DOUBLES,
    repetition_penalty=DOUBLES, stop=st.lists(TEXT.filter(lambda s: s == s.encode("utf-8", "replace").decode()),
                                              max_size=20),
    stop_token_ids=st.lists(UINT32, max_size=5), ignore_eos=st.booleans(), seed=st.integers(-(2**63), 2**63 - 1),
    n=UINT32, logprobs=st.booleans(), top_logprobs=UINT32, logit_bias=st.dictionaries(UINT32, DOUBLES, max_size=5),
    logprob_start_len=st.integers(-(2**31), 2**31 - 1),
    regex=st.none() | st.sampled_from(["a+", "[a-", ".?" * 40]),
    json_schema=st.none() | st.sampled_from(['{"type": "object"}', '{"$ref": "#"}', "nope"]))


@FUZZ
@given(PROTO_PARAMS, st.lists(st.integers(0, 2**32 - 1), max_size=80))
def test_proto_params_fail_only_with_the_domain_error(msg: sampling_pb2.SamplingParams, ids: list[int]) -> None:
    _only_domain_errors(lambda: validate_request(ids, sampling_from_proto(msg), VOCAB, CONTEXT_LEN))


# ---- valid requests parse and validate ---------------------------------------------------------------------
VALID_SAMPLING = st.fixed_dictionaries({}, optional={
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "n": st.integers(1, 4),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2), "seed": st.integers(0, 2**40),
    "stop": st.lists(st.text(min_size=1, max_size=8), max_size=4), "max_tokens": st.integers(1, 32),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=4)})
VALID_COMPLETIONS = st.builds(lambda prompt, fields: {"prompt": prompt, **fields},
                              st.text(min_size=1, max_size=20) | st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                                          max_size=8), VALID_SAMPLING)
VALID_CHATS = st.builds(lambda messages, fields: {"messages": messages, **fields},
                        st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                        "content": st.text(max_size=20)}), min_size=1, max_size=3),
                        VALID_SAMPLING)


@FUZZ
@given(VALID_COMPLETIONS)
def test_valid_completions_parse_and_validate(body: dict[str, Any]) -> None:
    _openai_pipeline(parse_body(json.dumps(body).encode(), CompletionRequest))


@FUZZ
@given(VALID_CHATS)
def test_valid_chats_parse_and_validate(body: dict[str, Any]) -> None:
    _openai_pipeline(parse_body(json.dumps(body).encode(), ChatCompletionRequest))


@FUZZ
@given(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16), st.integers(1, 32),
       st.floats(0, 2), st.integers(-1, 50))
def test_valid_proto_params_pass_admission(ids: list[int], max_new: int, temperature: float, top_k: int) -> None:
    msg = sampling_pb2.SamplingParams(max_new_tokens=max_new, temperature=temperature, top_k=top_k)
    params = sampling_from_proto(msg)
    validate_request(ids, params, VOCAB, CONTEXT_LEN)
    assert params.max_new_tokens == max_new and math.isclose(params.temperature, temperature)
    assert isinstance(params, SamplingParams)
