"""Tools through the public gRPC API: the same answers as the HTTP API, tool calls and their stream deltas in
the proto, and the proto's tool fields checked as the HTTP ones are."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest

from radixmesh.common.grpc_errors import from_rpc_error
from radixmesh.gateway.config import GatewayConfig
from radixmesh.protocol import common_pb2
from radixmesh.protocol import inference_pb2 as pb
from tests.unit.grpc_api_harness import Gateway, gateway
from tests.unit.scripted_backend import ScriptedBackend

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ANSWER = ('<think>\nCall it.\n</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
          "</tool_call>")
TOOLS = [pb.Tool(type="function", function=pb.FunctionDefinition(name="get_weather", description="Weather",
                                                                  parameters_json=json.dumps(PARAMS)))]
HTTP_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS}}]
HISTORY = [pb.ChatTurn(role="user", content="Weather in Oslo?"),
           pb.ChatTurn(role="assistant", tool_calls=[pb.ToolCall(id="call_1", type="function", function=pb.FunctionCall(
               name="get_weather", arguments='{"city": "Oslo"}'))]),
           pb.ChatTurn(role="tool", tool_call_id="call_1", content="-2 C")]
HTTP_HISTORY = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-2 C"}]


async def _both(run: Any) -> tuple[Any, Any, ScriptedBackend, ScriptedBackend]:
    config = GatewayConfig(grpc_port=0, reasoning_parser="qwen3")
    http_backend, grpc_backend = ScriptedBackend(ANSWER), ScriptedBackend(ANSWER)
    async with gateway(http_backend, config) as http_side, gateway(grpc_backend, config) as grpc_side:
        return *(await run(http_side, grpc_side)), http_backend, grpc_backend


def test_chat_with_tools_equals_http() -> None:
    async def run(http_side: Gateway, grpc_side: Gateway) -> tuple[Any, Any]:
        body = {"messages": HTTP_HISTORY, "tools": HTTP_TOOLS, "tool_choice": "required"}
        http = (await http_side.http.post("/v1/chat/completions", json=body)).json()
        reply = await grpc_side.stub.Chat(pb.ChatRequest(messages=HISTORY, tools=TOOLS,
                                                         tool_choice=pb.ToolChoice(mode="required")))
        return http, reply

    http, reply, http_backend, grpc_backend = asyncio.run(_both(run))
    assert grpc_backend.seen_params == http_backend.seen_params and grpc_backend.seen_params[0].structural_tag
    assert grpc_backend.seen_chats == http_backend.seen_chats
    choice, message = reply.choices[0], http["choices"][0]["message"]
    assert choice.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    assert choice.reasoning_content == message["reasoning_content"] == "Call it."
    assert [(c.index, c.type, c.function.name, c.function.arguments) for c in choice.tool_calls] == \
        [(i, c["type"], c["function"]["name"], c["function"]["arguments"]) for i, c in enumerate(message["tool_calls"])]
    assert all(c.id.startswith("call_") for c in choice.tool_calls)
    assert choice.content == "" and message["content"] is None


def test_stream_chat_tool_call_deltas() -> None:
    async def run(http_side: Gateway, grpc_side: Gateway) -> tuple[Any, Any]:
        request = pb.ChatRequest(messages=HISTORY[:1], tools=TOOLS, parallel_tool_calls=False,
                                 tool_choice=pb.ToolChoice(function_name="get_weather"))
        return None, [m async for m in grpc_side.stub.StreamChat(request)]

    _, messages, _, backend = asyncio.run(_both(run))
    thinking_or_not = json.loads(backend.seen_params[0].structural_tag or "")["format"]["elements"]
    assert thinking_or_not[1]["stop_after_first"] and thinking_or_not[1]["tags"][0]["begin"].endswith(
        '"get_weather", "arguments": ')
    calls = [c for m in messages for choice in m.choices for c in choice.tool_calls]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == "" and all(not c.id and not c.function.name for c in calls[1:])
    assert "".join(c.function.arguments for c in calls) == '{"city": "Oslo"}'
    assert "".join(choice.reasoning_content for m in messages for choice in m.choices) == "Call it."
    finishes = [choice.finish_reason for m in messages for choice in m.choices if choice.finish_reason]
    assert finishes == [common_pb2.FINISH_REASON_TOOL_CALLS]


@pytest.mark.parametrize(("request_pb", "param", "words"), [
    (pb.ChatRequest(messages=HISTORY[:1], tools=[pb.Tool(type="function", function=pb.FunctionDefinition(
        name="f", parameters_json="{not json"))]), "tools", "parameters_json"),
    (pb.ChatRequest(messages=HISTORY[:1], tools=TOOLS, tool_choice=pb.ToolChoice(function_name="nope")),
     "tool_choice", "nope"),
    (pb.ChatRequest(messages=HISTORY[:1], tools=TOOLS, tool_choice=pb.ToolChoice(mode="often")), "tool_choice",
     "often"),
    (pb.ChatRequest(messages=[*HISTORY[:2], pb.ChatTurn(role="tool", content="x")]), "messages", "tool_call_id"),
    (pb.ChatRequest(messages=HISTORY[:1], tools=[pb.Tool(type="retrieval", function=pb.FunctionDefinition(
        name="f"))]), "tools", "'function'"),
])
def test_bad_tool_fields_are_invalid_argument(request_pb: pb.ChatRequest, param: str, words: str) -> None:
    async def run(http_side: Gateway, grpc_side: Gateway) -> tuple[Any, Any]:
        try:
            await grpc_side.stub.Chat(request_pb)
        except grpc.aio.AioRpcError as exc:
            return exc, None
        raise AssertionError("the call succeeded")

    exc, _, _, backend = asyncio.run(_both(run))
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    error = from_rpc_error(exc, "gateway")
    assert error.param == param and words in error.message, error
    assert not backend.seen_params
