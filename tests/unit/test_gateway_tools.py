"""Tool calling and reasoning through the HTTP layer (scripted backend): prompts, constraints, answers and
streams in OpenAI's shapes, and the official `openai` client's tool-calling flow."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import xgrammar as xgr
from fastapi.testclient import TestClient

from radixmesh.gateway.app import create_app
from radixmesh.gateway.config import GatewayConfig
from tests.unit.scripted_backend import ScriptedBackend

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
HERMES_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
                '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
USER = [{"role": "user", "content": "Weather and time in Paris?"}]


def _client(backend: ScriptedBackend, **config: Any) -> TestClient:
    return TestClient(create_app(backend, GatewayConfig(**config)))


@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend(HERMES_CALLS, "It is sunny and 14:00.")


@pytest.fixture
def http(backend: ScriptedBackend) -> Iterator[TestClient]:
    with _client(backend) as client:
        yield client


def _sse(text: str) -> list[dict[str, Any]]:
    frames = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def _chat(http: TestClient, **body: Any) -> dict[str, Any]:
    response = http.post("/v1/chat/completions", json={"messages": USER, **body})
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def _tag(backend: ScriptedBackend) -> dict[str, Any]:
    tag = backend.seen_params[-1].structural_tag
    assert tag is not None
    xgr.Grammar.from_structural_tag(tag)  # it compiles
    value: dict[str, Any] = json.loads(tag)
    return value


# ---- answers ----------------------------------------------------------------------------------------------
def test_auto_answer_with_calls(http: TestClient, backend: ScriptedBackend) -> None:
    out = _chat(http, tools=[WEATHER, TIME])
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None and "reasoning_content" not in message
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] \
        == [("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {"zone": "CET"})]
    assert all(c["id"].startswith("call_") for c in message["tool_calls"])
    assert backend.seen_params[-1].structural_tag is None  # auto is not constrained without --strict-tools


def test_parallel_tool_calls_false_keeps_the_first_call(http: TestClient, backend: ScriptedBackend) -> None:
    backend.scripts = [HERMES_CALLS]
    message = _chat(http, tools=[WEATHER, TIME], parallel_tool_calls=False)["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    deltas = [e["choices"][0]["delta"] for e in _stream(http, tools=[WEATHER, TIME], parallel_tool_calls=False)]
    assert {c["index"] for d in deltas for c in d.get("tool_calls", [])} == {0}


def test_answer_without_calls_keeps_the_usual_shape(backend: ScriptedBackend) -> None:
    backend.scripts = ["Plain answer."]
    with _client(backend) as http:
        out = _chat(http, tools=[WEATHER])
        assert out["choices"][0]["message"] == {"role": "assistant", "content": "Plain answer."}
        assert out["choices"][0]["finish_reason"] == "stop"
        assert _chat(http)["choices"][0]["message"] == {"role": "assistant", "content": "Plain answer."}


def test_tool_choice_none_renders_no_tools_and_parses_nothing(http: TestClient, backend: ScriptedBackend) -> None:
    out = _chat(http, tools=[WEATHER], tool_choice="none")
    assert out["choices"][0]["message"]["content"] == HERMES_CALLS
    messages, tools = backend.seen_chats[-1]
    assert tools is None and messages == USER


def test_cut_answer_keeps_length(http: TestClient, backend: ScriptedBackend) -> None:
    backend.scripts = [HERMES_CALLS]
    choice = _chat(http, tools=[WEATHER, TIME], max_tokens=20)["choices"][0]  # 60 characters: name, not arguments
    assert choice["finish_reason"] == "length"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == \
        [("get_weather", '{"city": "P')]
    choice = _chat(http, tools=[WEATHER, TIME], max_tokens=8)["choices"][0]  # cut before the name: text
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == HERMES_CALLS[:24]


# ---- prompts ----------------------------------------------------------------------------------------------
def test_template_without_tools_gets_them_as_text(http: TestClient, backend: ScriptedBackend) -> None:
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "14 C"}]
    _chat(http, messages=history, tools=[WEATHER])
    messages, tools = backend.seen_chats[-1]
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == \
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert messages[3]["content"] == "<tool_response>\n14 C\n</tool_response>"


def test_template_with_tools_gets_them_as_they_are() -> None:
    backend = ScriptedBackend(HERMES_CALLS, takes_tools=True, tool_syntax="hermes")
    history = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "name": "get_weather", "content": "14 C"}]
    with _client(backend) as http:
        _chat(http, messages=history, tools=[WEATHER])
    messages, tools = backend.seen_chats[-1]
    assert tools == [WEATHER]
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_9", "name": "get_weather", "arguments": '{"city": "Paris"}'}]}
    assert messages[2] == {"role": "tool", "content": "14 C", "tool_call_id": "call_9", "name": "get_weather"}


# ---- constraints ------------------------------------------------------------------------------------------
def test_required_constrains_to_calls_of_the_tools(http: TestClient, backend: ScriptedBackend) -> None:
    _chat(http, tools=[WEATHER, TIME], tool_choice="required")
    fmt = _tag(backend)["format"]
    assert fmt["type"] == "tags_with_separator" and fmt["at_least_one"] and not fmt["stop_after_first"]
    assert [t["content"]["json_schema"] for t in fmt["tags"]] == [WEATHER["function"]["parameters"],
                                                                  TIME["function"]["parameters"]]
    _chat(http, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert _tag(backend)["format"]["stop_after_first"]


def test_named_function_constrains_to_that_one(http: TestClient, backend: ScriptedBackend) -> None:
    _chat(http, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    fmt = _tag(backend)["format"]
    assert [t["begin"] for t in fmt["tags"]] == ['<tool_call>\n{"name": "get_time", "arguments": ']
    assert fmt["stop_after_first"]


def test_strict_tools_constrains_auto(backend: ScriptedBackend) -> None:
    with _client(backend, strict_tools=True) as http:
        _chat(http, tools=[WEATHER])
        assert _tag(backend)["format"]["type"] == "triggered_tags"
        _chat(http)  # no tools: nothing to constrain
        assert backend.seen_params[-1].structural_tag is None


def test_parser_flag_changes_syntax_and_special_tokens(backend: ScriptedBackend) -> None:
    backend.scripts = ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]']
    with _client(backend, tool_call_parser="mistral") as http:
        out = _chat(http, tools=[WEATHER], tool_choice="required")
        assert out["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
        params = backend.seen_params[-1]
        assert params.skip_special_tokens is False
        assert _tag(backend)["format"]["begin"] == "[TOOL_CALLS]["


# ---- streams ----------------------------------------------------------------------------------------------
def _stream(http: TestClient, **body: Any) -> list[dict[str, Any]]:
    with http.stream("POST", "/v1/chat/completions", json={"messages": USER, "stream": True, **body}) as response:
        assert response.status_code == 200
        return _sse(response.read().decode())


@pytest.mark.parametrize("chunk_chars", [1, 3, 17, 1000])
def test_streamed_calls_as_openai_sends_them(chunk_chars: int) -> None:
    backend = ScriptedBackend("Let me check.\n" + HERMES_CALLS, chunk_chars=chunk_chars)
    with _client(backend) as http:
        whole = _chat(http, tools=[WEATHER, TIME])["choices"][0]
        events = _stream(http, tools=[WEATHER, TIME])
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    calls: dict[int, dict[str, str]] = {}
    content = ""
    for delta in deltas[1:]:
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] not in calls and call["type"] == "function"
                assert call["function"]["arguments"] == ""
                calls[call["index"]] = {"id": call["id"], "name": call["function"]["name"], "arguments": ""}
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
            calls[call["index"]]["arguments"] += call["function"]["arguments"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert content == whole["message"]["content"] == "Let me check."
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]


# ---- reasoning --------------------------------------------------------------------------------------------
THINKING = "<think>\nThe user wants weather.\n</think>\n\n" + HERMES_CALLS


def test_reasoning_parser_separates_reasoning(backend: ScriptedBackend) -> None:
    backend.scripts = [THINKING]
    with _client(backend, reasoning_parser="qwen3") as http:
        message = _chat(http, tools=[WEATHER, TIME])["choices"][0]["message"]
        assert message["reasoning_content"] == "The user wants weather." and len(message["tool_calls"]) == 2
        streamed = "".join(e["choices"][0]["delta"].get("reasoning_content") or "" for e in _stream(http))
        assert streamed == "The user wants weather."
        assert "reasoning_content" not in _chat(http, include_reasoning=False)["choices"][0]["message"]
        assert _chat(http, separate_reasoning=False)["choices"][0]["message"]["content"] == THINKING
        _chat(http, tools=[WEATHER], tool_choice="required")
        assert _tag(backend)["format"]["type"] == "or"  # thinking first, then the calls


# ---- the official client ----------------------------------------------------------------------------------
def _openai(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_tool_calling_flow(stream: bool) -> None:
    backend = ScriptedBackend(HERMES_CALLS, "Sunny, 14 C, and it is 14:00.")
    with _client(backend) as http:
        client = _openai(http)
        messages: list[Any] = list(USER)
        if stream:
            calls: dict[int, dict[str, str]] = {}
            finish = None
            for chunk in client.chat.completions.create(model="default", messages=messages, tools=[WEATHER, TIME],
                                                        stream=True):
                for call in chunk.choices[0].delta.tool_calls or []:
                    entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                    entry["id"] += call.id or ""
                    entry["name"] += (call.function.name or "") if call.function else ""
                    entry["arguments"] += (call.function.arguments or "") if call.function else ""
                finish = chunk.choices[0].finish_reason or finish
            assert finish == "tool_calls"
            tool_calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"],
                                                                         "arguments": c["arguments"]}}
                          for c in calls.values()]
        else:
            answer = client.chat.completions.create(model="default", messages=messages, tools=[WEATHER, TIME])
            assert answer.choices[0].finish_reason == "tool_calls"
            tool_calls = [c.model_dump() for c in answer.choices[0].message.tool_calls or []]
        assert [c["function"]["name"] for c in tool_calls] == ["get_weather", "get_time"]
        messages.append({"role": "assistant", "content": None, "tool_calls": tool_calls})
        for call in tool_calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "14 C" if "weather" in
                             call["function"]["name"] else "14:00"})
        final = client.chat.completions.create(model="default", messages=messages, tools=[WEATHER, TIME])
        assert final.choices[0].message.content == "Sunny, 14 C, and it is 14:00."
        assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
        rendered, _ = backend.seen_chats[-1]
        assert rendered[-1]["content"] == "<tool_response>\n14 C\n</tool_response>\n<tool_response>\n14:00\n" \
                                          "</tool_response>"
