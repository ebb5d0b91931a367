"""OpenAI's Responses API, stateless: POST /v1/responses over the chat machinery.

A request becomes a chat request (input items -> messages, `instructions` -> a system message first,
Responses tools -> chat tools, `text.format` -> response_format) and runs as one: the same template,
tool-call parser, constraints, reasoning parser and admission. Its answer becomes output items:
`reasoning`, `message` (output_text) and `function_call`, whole or as the API's streaming events
(responses_stream). Nothing is stored: `previous_response_id` is refused and every request carries
the whole conversation, function_call and function_call_output items included.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from radixmesh.common.errors import invalid_argument, unsupported
from radixmesh.gateway import openai_convert as conv
from radixmesh.gateway.openai_api import ChatRun, start_chat
from radixmesh.gateway.protocol import ChatCompletionRequest, parse_body, validate_data
from radixmesh.gateway.responses_protocol import ResponseObject, ResponsesRequest
from radixmesh.gateway.responses_stream import (
    ResponseEvents,
    finished,
    function_call_item,
    message_item,
    reasoning_item,
)
from radixmesh.gateway.sse import EventStreamResponse
from radixmesh.gateway.state import get_state, unless_disconnected
from radixmesh.gateway.tools.request import named_choice, tool_spec

router = APIRouter(prefix="/v1", tags=["openai"])
CHAT_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text"}
"""Chat request fields -> the Responses fields they came from (for error messages)."""
_PASSED_FIELDS = ("model", "temperature", "top_p", "seed", "stop", "parallel_tool_calls", "top_k", "min_p",
                  "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
                  "json_schema", "regex", "ebnf", "include_reasoning")


@router.post("/responses")
async def create_response(request: Request) -> Response:
    state = get_state(request)
    req = parse_body(await request.body(), ResponsesRequest)
    with conv.openai_names(CHAT_NAMES):
        run = await start_chat(state, chat_request(req))
    base = response_base(req, run)
    if req.stream:
        return EventStreamResponse(ResponseEvents(run, base).frames(), on_close=run.generation.aclose)
    try:
        return Response((await unless_disconnected(request, collect(run, base))).model_dump_json(),
                        media_type="application/json")
    finally:
        await run.generation.aclose()


def response_base(req: ResponsesRequest, run: ChatRun) -> ResponseObject:
    """The response as it starts (status in_progress, no output), echoing the request's settings."""
    return ResponseObject(
        id=f"resp_{uuid.uuid4().hex}", model=run.model, instructions=req.instructions,
        max_output_tokens=req.max_output_tokens, parallel_tool_calls=req.parallel_tool_calls is not False,
        temperature=req.temperature, top_p=req.top_p, tool_choice=req.tool_choice or "auto", tools=req.tools or [],
        text={"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
        if req.text is not None and req.text.format is not None else {"format": {"type": "text"}},
        metadata=req.metadata or {})


async def collect(run: ChatRun, base: ResponseObject) -> ResponseObject:
    chat = await run.collect()
    out = run.outputs[0]
    items: list[dict[str, Any]] = []
    if out.reasoning:
        items.append(reasoning_item(out.reasoning))
    if out.content or not out.calls:
        items.append(message_item(out.content))
    items += [function_call_item(call.id, call.name, call.arguments) for call in out.calls]
    return finished(base, items, chat.choices[0].finish_reason, run)


# ---- request -> chat request --------------------------------------------------------------------------
def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    if req.previous_response_id is not None:
        raise unsupported("previous_response_id is not supported: this server stores no responses; send the whole "
                          "conversation in input", "previous_response_id")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += input_messages(req.input)
    data: dict[str, Any] = {"messages": messages, "stream": req.stream}
    data.update({name: getattr(req, name) for name in _PASSED_FIELDS if getattr(req, name) is not None})
    if req.max_output_tokens is not None:
        data["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        data["tools"] = chat_tools(req.tools)
    if isinstance(req.tool_choice, dict):
        data["tool_choice"] = {"type": "function",
                               "function": {"name": named_choice(req.tool_choice, nested=False)}}
    elif req.tool_choice is not None:
        data["tool_choice"] = req.tool_choice
    if req.text is not None and req.text.format is not None:
        data["response_format"] = response_format(req.text.format.model_dump(by_alias=True, exclude_none=True))
    return validate_data(data, ChatCompletionRequest)


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses function tools (flat) as chat tools; other tool types are refused by name."""
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise unsupported(f"tools[{i}] of type {kind!r} is not supported; only function tools are", "tools")
        spec = tool_spec(tool.get("name"), tool.get("description"), tool.get("parameters"), f"tools[{i}]")
        out.append(spec.openai())
    return out


def response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type")}
    return {"type": "json_schema", "json_schema": {key: fmt[key] for key in ("name", "schema", "strict", "description")
                                                    if key in fmt}}


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function_call items form one assistant turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": _role(item, i), "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                             "content": _text(item.get("output"), f"input[{i}].output")})
        elif kind != "reasoning":
            raise unsupported(f"input[{i}] of type {kind!r} is not supported (use message, function_call or "
                              "function_call_output)", "input")
    if not messages:
        raise invalid_argument("input has no messages", "input")
    return messages


def _role(item: dict[str, Any], i: int) -> str:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise invalid_argument(f"input[{i}].role must be user, system, developer or assistant (got {role!r})", "input")
    return str(role)


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise invalid_argument(f"input[{i}].{key} must be a non-empty string", "input")
    return value


def _text(content: Any, where: str) -> str:
    """A content string, or the text of input_text / output_text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_argument(f"{where} must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise unsupported(f"{where}[{j}] of type {kind!r} is not supported; only text parts are", "input")
        texts.append(part["text"])
    return "\n".join(texts)
