"""Structured outputs end to end on the default model: `radixmesh serve` over HTTP, sampled at
temperature 1.0, 32 generations per grammar in one batched request; jump-forward on and off.

Schemas bound their free parts (patterns, enums, bounded numbers, min/maxItems) so that a
sampling 135M model finishes well within max_tokens; every output must then be complete and
valid, and `finish_reason` must be `stop`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest

from tests.integration.service_procs import ServiceProc, start_service, stop_all, wait_all_ready

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_SAMPLES = 32
"""Samples per grammar. Decoding them is compute-bound on a 2-core CPU (a batch-32 step of the 135M model is
~100 ms): 50 took the module to 120-160 s of the suite's 15 minutes; each grammar kind, schema and mode stays."""
SEED = 20261126
"""Sampled requests are seeded (branch i of n gets SEED + i): the same outputs, and the same run time, every run."""
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["engineer", "doctor", "artist", "teacher"]},
        "verified": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "verified"],
}
ORDER = {  # nested objects, an array of objects, enums, bounded numbers
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1000, "maximum": 9999},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                           "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                           "price": {"type": "number", "minimum": 0, "maximum": 500}},
            "required": ["sku", "quantity", "price"]}},
        "shipping": {"type": "object", "properties": {"city": {"enum": ["Paris", "Berlin", "Tokyo"]},
                                                      "express": {"type": "boolean"}},
                     "required": ["city", "express"]},
    },
    "required": ["order_id", "items", "shipping"],
}
READING = {  # an optional field, an array of bounded numbers
    "type": "object",
    "properties": {
        "sensor": {"enum": ["temp-1", "temp-2", "humidity"]},
        "values": {"type": "array", "items": {"type": "number", "minimum": -40, "maximum": 60},
                   "minItems": 2, "maxItems": 4},
        "unit": {"type": "string", "enum": ["C", "F", "%"]},
        "note": {"type": "string", "pattern": "^[a-z ]{0,16}$"},
    },
    "required": ["sensor", "values", "unit"],
}
LONG_KEYS = {  # forced text dominates: what jump-forward skips
    "type": "object",
    "properties": {
        "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 9},
        "delivery_address_has_been_confirmed": {"type": "boolean"},
        "preferred_notification_channel": {"enum": ["email_message", "text_message"]},
    },
    "required": ["customer_account_identifier", "delivery_address_has_been_confirmed",
                 "preferred_notification_channel"],
}
REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]) (cat|dog|bird)"
EBNF = """root ::= "(" expr ")"
expr ::= term (op term){0,5}
term ::= [1-9] | "(" [1-9] (op [1-9]){1,3} ")"
op ::= "+" | "*"
"""


def parse_expr(text: str) -> bool:
    """A recursive-descent parser for (a superset of) EBNF above, independent of the grammar engine."""
    pos = 0

    def term() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos] in "123456789":
            pos += 1
            return True
        return paren()

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(text) and text[pos] in "+*":
            pos += 1
            if not term():
                return False
        return True

    def paren() -> bool:
        nonlocal pos
        if pos >= len(text) or text[pos] != "(":
            return False
        pos += 1
        if not expr() or pos >= len(text) or text[pos] != ")":
            return False
        pos += 1
        return True

    return paren() and pos == len(text)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServiceProc]]:
    """`serve` with jump-forward off ("plain") and on ("jf"), started together."""
    procs = {"plain": start_service("serve", [], http=True, wait_ready=False),
             "jf": start_service("serve", ["--enable-jump-forward"], http=True, wait_ready=False)}
    wait_all_ready(list(procs.values()))
    yield procs
    stop_all(list(procs.values()))


@pytest.fixture(scope="module")
def server(servers: dict[str, ServiceProc]) -> ServiceProc:
    return servers["plain"]


@pytest.fixture(scope="module")
def server_jf(servers: dict[str, ServiceProc]) -> ServiceProc:
    return servers["jf"]


def post(server: ServiceProc, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.address + path, json=body, timeout=1800)


def chat(server: ServiceProc, content: str, **fields: Any) -> dict[str, Any]:
    response = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}], **fields})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def forward_passes(server: ServiceProc) -> int:
    return int(httpx.get(server.address + "/server_info", timeout=60).json()["num_forward_passes"])


def assert_all_valid(choices: list[dict[str, Any]], schema: dict[str, Any]) -> None:
    assert len(choices) == NUM_SAMPLES
    for choice in choices:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


@pytest.mark.parametrize("schema", [PERSON, ORDER, READING], ids=["person", "order", "reading"])
def test_json_schema_samples_all_validate(server, schema):
    body = chat(server, "Answer in JSON.", n=NUM_SAMPLES, temperature=1.0, max_tokens=256, seed=SEED,
                response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                        "strict": True}})
    assert_all_valid(body["choices"], schema)
    assert len({c["message"]["content"] for c in body["choices"]}) > 1  # sampled, not one forced answer


def test_regex_samples_all_fullmatch(server):
    response = post(server, "/v1/completions", {"prompt": "A date and a pet:", "n": NUM_SAMPLES, "temperature": 1.0,
                                                "max_tokens": 32, "regex": REGEX, "seed": SEED})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == NUM_SAMPLES
    for choice in choices:
        assert choice["finish_reason"] == "stop" and re.fullmatch(REGEX, choice["text"]), choice


def test_ebnf_samples_all_parse(server):
    response = post(server, "/generate", {"text": "An arithmetic expression:", "sampling_params": {
        "n": NUM_SAMPLES, "temperature": 1.0, "max_new_tokens": 128, "ebnf": EBNF, "seed": SEED}})
    assert response.status_code == 200, response.text
    results = response.json()
    assert len(results) == NUM_SAMPLES
    for result in results:
        assert result["meta_info"]["finish_reason"]["type"] == "stop", result
        assert parse_expr(result["text"]), result["text"]


def test_json_object_is_json(server):
    body = chat(server, "Give me a JSON object about cats.", n=8, temperature=0.7, max_tokens=192, seed=SEED,
                response_format={"type": "json_object"})
    finished = [c for c in body["choices"] if c["finish_reason"] == "stop"]
    assert finished, "no json_object sample finished within max_tokens"
    for choice in finished:
        assert isinstance(json.loads(choice["message"]["content"]), dict | list)


def test_max_tokens_mid_structure_is_length(server):
    body = chat(server, "Answer in JSON.", max_tokens=6, temperature=0.0,
                response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ORDER}})
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 6
    assert choice["message"]["content"].startswith('{"order_id":')


def test_jump_forward_valid_with_fewer_forward_passes(server, server_jf):
    prompts = ["Fill in the customer record.", "Customer profile as JSON:", "Record:", "Account settings:"]
    params = {"temperature": 0.0, "max_new_tokens": 128, "json_schema": json.dumps(LONG_KEYS)}
    used = {}
    for name, srv in (("off", server), ("on", server_jf)):
        before = forward_passes(srv)
        response = post(srv, "/generate", {"text": prompts, "sampling_params": params})
        assert response.status_code == 200, response.text
        for result in response.json():
            assert result["meta_info"]["finish_reason"]["type"] == "stop", result
            jsonschema.validate(json.loads(result["text"]), LONG_KEYS)
        used[name] = forward_passes(srv) - before
    assert used["on"] < used["off"] * 0.6, used


def test_jump_forward_samples_all_validate(server_jf):
    body = chat(server_jf, "Answer in JSON.", n=NUM_SAMPLES, temperature=1.0, max_tokens=256, seed=SEED,
                response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}})
    assert_all_valid(body["choices"], ORDER)


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wrong"}}}},
     "response_format"),
    ({"regex": "[0-9"}, "regex"),
    ({"ebnf": "root ::= missing_rule"}, "ebnf"),
    ({"json_schema": "{"}, "json_schema"),
])
def test_invalid_specs_are_400(server, fields, param):
    response = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
