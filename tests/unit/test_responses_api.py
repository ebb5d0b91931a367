"""/v1/responses over the chat machinery (scripted backend): input items, tools, output items, the event
stream, errors, and the official `openai` client reading all of them."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from radixmesh.gateway.app import create_app
from radixmesh.gateway.config import GatewayConfig
from tests.unit.scripted_backend import ScriptedBackend

TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL_TEXT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
THINKING = "<think>\nThe user asks about Lima.\n</think>\n\n" + CALL_TEXT


def _http(backend: ScriptedBackend, **config: Any) -> TestClient:
    return TestClient(create_app(backend, GatewayConfig(**config)))


def _events(text: str) -> list[dict[str, Any]]:
    events = []
    for frame in text.strip().split("\n\n"):
        kind, data = frame.split("\n", 1)
        assert kind.startswith("event: ") and data.startswith("data: ")
        event = json.loads(data[len("data: "):])
        assert event["type"] == kind[len("event: "):]
        events.append(event)
    return events


def test_function_call_items_and_usage() -> None:
    backend = ScriptedBackend(CALL_TEXT)
    with _http(backend) as http:
        response = http.post("/v1/responses", json={"model": "default", "input": "Weather in Lima?", "tools": [TOOL],
                                                    "instructions": "Be brief.", "max_output_tokens": 200})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "response" and body["status"] == "completed" and body["id"].startswith("resp_")
    assert [item["type"] for item in body["output"]] == ["message", "function_call"]
    assert body["output"][0]["content"][0] == {"type": "output_text", "text": "Checking.", "annotations": [],
                                               "logprobs": []}
    call = body["output"][1]
    assert (call["name"], call["arguments"], call["status"]) == ("get_weather", '{"city": "Lima"}', "completed")
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    usage = body["usage"]
    assert usage["output_tokens"] == -(-len(CALL_TEXT) // 3)  # the scripted backend: one token per 3 characters
    assert usage["input_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    messages, _ = backend.seen_chats[-1]
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert backend.seen_params[-1].max_new_tokens == 200


def test_input_items_become_the_conversation() -> None:
    backend = ScriptedBackend("It is 20 C in Lima.", takes_tools=True)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Lima?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": '{"city": "Lima"}'},
             {"type": "function_call_output", "call_id": "call_7", "output": "20 C"}]
    with _http(backend) as http:
        body = http.post("/v1/responses", json={"input": items, "tools": [TOOL]}).json()
    assert [item["type"] for item in body["output"]] == ["message"]
    messages, tools = backend.seen_chats[-1]
    assert tools == [{"type": "function", "function": {"name": "get_weather", "parameters": TOOL["parameters"],
                                                       "description": "Weather of a city"}}]
    assert messages == [
        {"role": "user", "content": "Weather in Lima?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_7", "name": "get_weather", "arguments": '{"city": "Lima"}'}]},
        {"role": "tool", "content": "20 C", "tool_call_id": "call_7"}]


def test_stream_events() -> None:
    backend = ScriptedBackend(THINKING, chunk_chars=4)
    with _http(backend, reasoning_parser="qwen3") as http, \
            http.stream("POST", "/v1/responses", json={"input": "Weather in Lima?", "tools": [TOOL], "stream": True}) \
            as response:
        assert response.status_code == 200
        events = _events(response.read().decode())
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == \
        "The user asks about Lima."
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Checking."
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert arguments == '{"city": "Lima"}'
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][2]["arguments"] == arguments and final["status"] == "completed"
    done = [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
    assert done == [item["id"] for item in final["output"]]


def test_cut_by_max_output_tokens_is_incomplete() -> None:
    with _http(ScriptedBackend("a long answer " * 10)) as http:
        body = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3}).json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"input": 5}, "input", "input"),
    ({"input": []}, "input", "no messages"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input", "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 3}]}, "input",
     "input[0].arguments"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
    ({"input": [{"type": "computer_call"}]}, "input", "computer_call"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"input": "hi", "tools": [{"type": "function", "name": 7}]}, "tools", "tools[0].name"),
    ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"input": "hi", "tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text", "schema"),
])
def test_bad_requests_are_400_naming_the_field(body: dict[str, Any], param: str, words: str) -> None:
    backend = ScriptedBackend("x")
    with _http(backend) as http:
        response = http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert not backend.seen_params


def test_openai_client_reads_responses_and_their_stream() -> None:
    backend = ScriptedBackend(CALL_TEXT, "It is 20 C in Lima.", chunk_chars=5)
    with _http(backend) as http:
        client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0)
        first = client.responses.create(model="default", input="Weather in Lima?", tools=[TOOL],  # type: ignore[list-item]
                                        tool_choice="required")
        calls = [item for item in first.output if item.type == "function_call"]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Lima"})]
        follow_up: list[Any] = [{"role": "user", "content": "Weather in Lima?"}, *[c.model_dump() for c in calls],
                                {"type": "function_call_output", "call_id": calls[0].call_id, "output": "20 C"}]
        stream = client.responses.create(model="default", input=follow_up, tools=[TOOL], stream=True)  # type: ignore[list-item]
        events = list(stream)
        assert events[-1].type == "response.completed"
        assert events[-1].response.output_text == "It is 20 C in Lima."
