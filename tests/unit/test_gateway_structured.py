"""Structured-output fields through the HTTP layer (fake backend): what reaches the engine, and 400s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from radixmesh.gateway.app import create_app
from radixmesh.gateway.config import GatewayConfig

from .test_gateway_api import FakeBackend

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["a"]}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"prompt": "hi", "max_tokens": 3}


def _native(**sampling: Any) -> dict[str, Any]:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 2, **sampling}}


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def http(backend: FakeBackend) -> Iterator[TestClient]:
    with TestClient(create_app(backend, GatewayConfig())) as client:
        yield client


def _grammar(backend: FakeBackend) -> tuple[str | None, str | None, str | None]:
    params = backend.seen_params[-1]
    return params.json_schema, params.regex, params.ebnf


@pytest.mark.parametrize(("route", "base"), [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize(("extra", "expected"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     (json.dumps(SCHEMA), None, None)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": False}}},
     (json.dumps(SCHEMA), None, None)),
    ({"response_format": {"type": "json_object"}}, ("$$ANY$$", None, None)),
    ({"response_format": {"type": "text"}}, (None, None, None)),
    ({"json_schema": SCHEMA}, (json.dumps(SCHEMA), None, None)),
    ({"json_schema": json.dumps(SCHEMA, indent=1)}, (json.dumps(SCHEMA, indent=1), None, None)),
    ({"regex": "[0-9]+"}, (None, "[0-9]+", None)),
    ({"ebnf": 'root ::= "a"'}, (None, None, 'root ::= "a"')),
])
def test_openai_structured_fields_reach_the_engine(http: TestClient, backend: FakeBackend, route: str,
                                                   base: dict[str, Any], extra: dict[str, Any],
                                                   expected: tuple[str | None, ...]) -> None:
    response = http.post(route, json={**base, **extra})
    assert response.status_code == 200, response.text
    assert _grammar(backend) == expected


@pytest.mark.parametrize(("sampling", "expected"), [
    ({"json_schema": json.dumps(SCHEMA)}, (json.dumps(SCHEMA), None, None)),
    ({"json_schema": SCHEMA}, (json.dumps(SCHEMA), None, None)),
    ({"regex": "(yes|no)"}, (None, "(yes|no)", None)),
    ({"ebnf": 'root ::= "a" | "b"'}, (None, None, 'root ::= "a" | "b"')),
])
def test_native_sampling_params_carry_grammars(http: TestClient, backend: FakeBackend, sampling: dict[str, Any],
                                               expected: tuple[str | None, ...]) -> None:
    response = http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2, **sampling}})
    assert response.status_code == 200, response.text
    assert _grammar(backend) == expected


@pytest.mark.parametrize(("route", "body", "param", "words"), [
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format", "nonsense"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "structural_tag"}}, "response_format",
     "needs format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "structural_tag", "format": {"type": "nope"}}},
     "response_format", "structural tag"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format", "not supported"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}, "regex": "a"}, "response_format",
     "either"),
    ("/v1/chat/completions", {**CHAT, "regex": "(unclosed"}, "regex", "regex"),
    ("/v1/completions", {**COMPLETION, "ebnf": "root ::= undefined_rule"}, "ebnf", "undefined_rule"),
    ("/v1/completions", {**COMPLETION, "json_schema": "{broken"}, "json_schema", "not valid json"),
    ("/v1/completions", {**COMPLETION, "regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", "at most one"),
    ("/generate", _native(regex="a[b"), "regex", "regex"),
    ("/generate", _native(json_schema='{"type": 5}'), "json_schema", "type"),
    ("/generate", _native(structural_tag="{}"), "structural_tag", "format field"),
    ("/generate", _native(structural_tag={"type": "structural_tag", "format": {"type": "tag", "begin": "<a>",
                                                                               "content": {"type": "any_text"}}}),
     "structural_tag", "end"),
])
def test_invalid_grammars_are_400_naming_the_problem(http: TestClient, backend: FakeBackend, route: str,
                                                     body: dict[str, Any], param: str, words: str) -> None:
    response = http.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert words.lower() in error["message"].lower(), error["message"]
    assert not backend.seen_params, "an invalid grammar reached the engine"
