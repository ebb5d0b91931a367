"""Tool calling on the default model (CPU), through `radixmesh serve` and through the cluster's services.

- `tool_choice: required`: calls sampled at temperature 1 to tools with nested schemas all parse and validate
  (constrained decoding); the rates over 100 calls, with and without the constraint, are `radixmesh bench
  tool-calls`'s to measure (docs/tools.md).
- The official `openai` client's flow (call, tool result, final answer), streaming and not, on chat and on
  the Responses API.
- The services path: a gateway over a tokenizer service whose chat template renders tools (tools reach the
  template: the prompt is what that template makes of them), and the public gRPC API's tool calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from loadtests.tool_calls import TOOLS, call_problem, run
from radixmesh.engine.hf_tokenizer import load_tokenizer, render_chat
from radixmesh.protocol import inference_pb2, inference_pb2_grpc
from tests.integration.service_procs import ServiceProc, start_service, stop_all, wait_all_ready
from tests.ports import free_port
from tests.tool_template import tool_template_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENGINE = ["--device", "cpu", "--max-total-tokens", "16384"]
"""The shared system block (~780 tokens with the tools) is cached once; the sampled answers of ~100 tokens fit."""
REQUIRED_CALLS = 16
"""Answers of the `required` test: 4 per prompt of loadtests/tool_calls.py (each of its three tools asked for),
in one batch. Unconstrained, the default model writes no call at all (docs/tools.md: 0 of 100), so a broken
constraint fails every answer; the rate over 100 calls is the benchmark's figure, not the test's."""
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
WEATHER = TOOLS[2]
QUESTION = [{"role": "user", "content": "What is the weather like in Kyoto right now?"}]
GATEWAY_GRPC_PORT = free_port()
"""The gateway's public gRPC API."""


@pytest.fixture(scope="module")
def procs(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServiceProc]]:
    """`serve`, and a gateway (with the public gRPC API) over a worker and a tokenizer service whose template
    takes tools, started together."""
    template_dir = tool_template_dir(default_model_dir, tmp_path_factory.mktemp("tool-template"))
    tokenizer = start_service("tokenizer", ["--tokenizer", str(template_dir), "--metrics-port", "-1"],
                              wait_ready=False)
    worker = start_service("worker", [*ENGINE, "--worker-id", "tools-w"], wait_ready=False)
    services = {
        "serve": start_service("serve", ENGINE, http=True, wait_ready=False),
        "tokenizer": tokenizer, "worker": worker,
        "gateway": start_service("gateway", ["--worker", worker.address, "--tokenizer", tokenizer.address,
                                             "--grpc-port", str(GATEWAY_GRPC_PORT)], http=True, wait_ready=False)}
    wait_all_ready(list(services.values()))
    yield services
    stop_all(list(services.values()))


def _client(proc: ServiceProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proc.address}/v1", api_key="unused", timeout=3600, max_retries=0)


@pytest.mark.timeout(3600)
def test_required_calls_sampled_at_temperature_1_all_parse_and_validate(procs: dict[str, ServiceProc]) -> None:
    result = run(procs["serve"].address, "required", num_calls=REQUIRED_CALLS)
    print(json.dumps({"tool_choice": result.tool_choice, "answers": result.answers, "rate": result.rate}))
    assert result.answers == REQUIRED_CALLS and result.calls == REQUIRED_CALLS, result
    assert result.valid_calls == REQUIRED_CALLS and result.valid_answers == REQUIRED_CALLS, result.failures
    assert result.finish_reasons == {"tool_calls": REQUIRED_CALLS}


def _assert_valid(calls: list[Any]) -> None:
    assert calls
    for call in calls:
        assert call_problem(call.model_dump(), SCHEMAS) == ""


# The client flows ask for one call (parallel_tool_calls false): with parallel calls allowed, the default model
# at temperature 0 repeats its call (every one valid) until max_tokens, a property of the 135M model, not of
# the grammar; docs/tools.md says so.
ONE_CALL = {"parallel_tool_calls": False}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_client_chat_flow(procs: dict[str, ServiceProc], stream: bool) -> None:
    client = _client(procs["serve"])
    messages: list[Any] = list(QUESTION)
    first = client.chat.completions.create(model="default", messages=messages, tools=[WEATHER],
                                           tool_choice="required", temperature=0, max_tokens=200, **ONE_CALL)
    assert first.choices[0].finish_reason == "tool_calls"
    calls = first.choices[0].message.tool_calls or []
    _assert_valid(calls)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear", "celsius": 18}'}
                 for call in calls]
    if not stream:
        final = client.chat.completions.create(model="default", messages=messages, tools=[WEATHER],
                                               tool_choice="none", temperature=0, max_tokens=60)
        assert final.choices[0].message.content and not final.choices[0].message.tool_calls
        return
    pieces, finish = [], None
    for chunk in client.chat.completions.create(model="default", messages=messages, tools=[WEATHER],
                                                tool_choice="none", temperature=0, max_tokens=60, stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces).strip() and finish in ("stop", "length")


def test_openai_client_streams_a_constrained_call(procs: dict[str, ServiceProc]) -> None:
    client = _client(procs["serve"])
    arguments, names, finish = "", [], None
    for chunk in client.chat.completions.create(model="default", messages=QUESTION, tools=[WEATHER], stream=True,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                temperature=1, seed=7, max_tokens=200):
        for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            names += [call.function.name] if call.function and call.function.name else []
            arguments += call.function.arguments or "" if call.function else ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert call_problem({"function": {"name": "get_weather", "arguments": arguments}}, SCHEMAS) == ""


def test_openai_client_responses_flow(procs: dict[str, ServiceProc]) -> None:
    client = _client(procs["serve"])
    flat = {"type": "function", **WEATHER["function"]}
    first = client.responses.create(model="default", input=QUESTION[0]["content"], tools=[flat],  # type: ignore[list-item]
                                    tool_choice="required", temperature=0, max_output_tokens=200, **ONE_CALL)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    for call in calls:
        assert call_problem({"function": {"name": call.name, "arguments": call.arguments}}, SCHEMAS) == ""
    follow_up: list[Any] = [*QUESTION, *[c.model_dump(exclude_none=True) for c in calls],
                            *[{"type": "function_call_output", "call_id": c.call_id, "output": "18 C, clear"}
                              for c in calls]]
    events = list(client.responses.create(model="default", input=follow_up, tools=[flat], tool_choice="none",  # type: ignore[list-item]
                                          temperature=0, max_output_tokens=60, stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text.strip()


def test_gateway_renders_tools_with_the_tokenizer_services_template(procs: dict[str, ServiceProc],
                                                                      default_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    client = _client(procs["gateway"])
    answer = client.chat.completions.create(model="default", messages=QUESTION, tools=[WEATHER],
                                            tool_choice="required", temperature=1, seed=3, n=4, max_tokens=200)
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls"
        _assert_valid(choice.message.tool_calls or [])
    template = load_tokenizer(tool_template_dir(default_model_dir, tmp_path / "template"))
    expected = template.encode(render_chat(template, QUESTION, tools=[WEATHER]), add_special_tokens=False)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(expected)


def test_public_grpc_api_returns_tool_calls(procs: dict[str, ServiceProc]) -> None:
    function = WEATHER["function"]
    request = inference_pb2.ChatRequest(
        messages=[inference_pb2.ChatTurn(role="user", content=QUESTION[0]["content"])],
        tools=[inference_pb2.Tool(type="function", function=inference_pb2.FunctionDefinition(
            name=function["name"], description=function["description"],
            parameters_json=json.dumps(function["parameters"])))],
        tool_choice=inference_pb2.ToolChoice(function_name="get_weather"),
        options=inference_pb2.GenerationOptions(temperature=0, max_tokens=200))
    with grpc.insecure_channel(f"127.0.0.1:{GATEWAY_GRPC_PORT}") as channel:
        reply = inference_pb2_grpc.InferenceServiceStub(channel).Chat(request, timeout=3600)
    calls = reply.choices[0].tool_calls
    assert [c.function.name for c in calls] == ["get_weather"] and calls[0].id.startswith("call_")
    assert call_problem({"function": {"name": "get_weather", "arguments": calls[0].function.arguments}},
                        SCHEMAS) == ""
