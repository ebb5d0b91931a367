"""The public gRPC API's messages <-> the HTTP API's request and response models, field by field.

A gRPC request becomes the same pydantic request the HTTP API parses from JSON and is validated by the
same model (`validate_data`); the HTTP API's response objects (what it would serialize as JSON) become
the gRPC replies. Nothing here decides what is generated: defaults, bounds and conversion to sampling
parameters live in the HTTP layer's one code path (openai_convert), which both APIs go through.
"""

from __future__ import annotations

import json
from typing import Any, Literal, get_args

from radixmesh.common.errors import invalid_argument
from radixmesh.gateway.openai_convert import ChoiceState
from radixmesh.gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    ModelObject,
    Usage,
    validate_data,
)
from radixmesh.protocol import inference_pb2 as pb
from radixmesh.wire.convert import finish_reason_to_proto

_OptionalField = Literal["max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                        "presence_penalty", "repetition_penalty", "ignore_eos", "seed", "skip_special_tokens"]
_OPTIONAL_FIELDS: tuple[_OptionalField, ...] = get_args(_OptionalField)
"""GenerationOptions fields sent on only when set (unset takes the HTTP API's default); same names as OpenAI's."""


# ---- requests ---------------------------------------------------------------------------------------
def options_fields(options: pb.GenerationOptions) -> dict[str, Any]:
    """The HTTP request fields of GenerationOptions, logprobs aside (completions and chat name them apart)."""
    fields: dict[str, Any] = {name: getattr(options, name) for name in _OPTIONAL_FIELDS if options.HasField(name)}
    if options.stop:
        fields["stop"] = list(options.stop)
    if options.stop_token_ids:
        fields["stop_token_ids"] = list(options.stop_token_ids)
    if options.n:
        fields["n"] = options.n
    if options.logit_bias:
        fields["logit_bias"] = {str(token_id): bias for token_id, bias in options.logit_bias.items()}
    constraint = options.WhichOneof("constraint")
    if constraint == "json_object":
        if options.json_object:
            fields["response_format"] = {"type": "json_object"}
    elif constraint is not None:
        fields[constraint] = getattr(options, constraint)
    if options.top_logprobs and not options.logprobs:
        raise invalid_argument("top_logprobs needs logprobs set to true", "top_logprobs")
    return fields


def _stream_fields(stream: bool) -> dict[str, Any]:
    # A gRPC stream always ends with the usage message (HTTP asks for it with stream_options).
    return {"stream": True, "stream_options": {"include_usage": True}} if stream else {}


def completion_request(request: pb.CompleteRequest, stream: bool) -> CompletionRequest:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise invalid_argument("prompt is required: set text or token_ids", "prompt")
    prompt: str | list[int] = request.text if kind == "text" else list(request.token_ids.ids)
    options = request.options
    data: dict[str, Any] = {"prompt": prompt, "echo": request.echo, **options_fields(options),
                            "logprobs": options.top_logprobs if options.logprobs else None, **_stream_fields(stream)}
    if request.model:
        data["model"] = request.model
    return validate_data(data, CompletionRequest)


def chat_request(request: pb.ChatRequest, stream: bool) -> ChatCompletionRequest:
    options = request.options
    data: dict[str, Any] = {"messages": [_turn(m) for m in request.messages], **options_fields(options),
                            "logprobs": options.logprobs, **_stream_fields(stream), **_tool_fields(request)}
    if options.top_logprobs:
        data["top_logprobs"] = options.top_logprobs
    if request.model:
        data["model"] = request.model
    return validate_data(data, ChatCompletionRequest)


def _turn(turn: pb.ChatTurn) -> dict[str, Any]:
    """A ChatTurn as the HTTP API's message (tool fields only when set)."""
    message: dict[str, Any] = {"role": turn.role, "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": c.type or "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in turn.tool_calls]
    if turn.tool_call_id:
        message["tool_call_id"] = turn.tool_call_id
    if turn.name:
        message["name"] = turn.name
    return message


def _tool_fields(request: pb.ChatRequest) -> dict[str, Any]:
    """tools, tool_choice, parallel_tool_calls and include_reasoning as the HTTP API takes them."""
    fields: dict[str, Any] = {}
    if request.tools:
        fields["tools"] = [{"type": tool.type or "function", "function": _function(tool.function, i)}
                           for i, tool in enumerate(request.tools)]
    choice = request.tool_choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    if choice == "mode":
        fields["tool_choice"] = request.tool_choice.mode
    elif choice == "function_name":
        fields["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice.function_name}}
    if request.HasField("parallel_tool_calls"):
        fields["parallel_tool_calls"] = request.parallel_tool_calls
    if request.HasField("include_reasoning"):
        fields["include_reasoning"] = request.include_reasoning
    return fields


def _function(function: pb.FunctionDefinition, index: int) -> dict[str, Any]:
    out: dict[str, Any] = {"name": function.name}
    if function.description:
        out["description"] = function.description
    if function.parameters_json:
        try:
            out["parameters"] = json.loads(function.parameters_json)
        except ValueError:
            raise invalid_argument(f"tools[{index}].function.parameters_json is not valid JSON", "tools") from None
    if function.HasField("strict"):
        out["strict"] = function.strict
    return out


# ---- replies ----------------------------------------------------------------------------------------
class TokenCursor:
    """Output token ids of each choice not yet sent (a run's states grow as its stream is read)."""

    def __init__(self, states: list[ChoiceState]) -> None:
        self.states = states
        self.sent = [0] * len(states)

    def take(self, index: int) -> list[int]:
        ids = self.states[index].token_ids[self.sent[index]:]
        self.sent[index] += len(ids)
        return ids


def usage(value: Usage | None) -> pb.Usage | None:
    if value is None:
        return None
    return pb.Usage(prompt_tokens=value.prompt_tokens, completion_tokens=value.completion_tokens,
                    total_tokens=value.total_tokens, cached_tokens=value.prompt_tokens_details.cached_tokens)


def completion_logprobs(logprobs: CompletionLogprobs | None) -> list[pb.LogprobEntry]:
    if logprobs is None:
        return []
    entries = []
    for i, token in enumerate(logprobs.tokens):
        top = logprobs.top_logprobs[i] or {}
        entries.append(pb.LogprobEntry(
            token=token, logprob=logprobs.token_logprobs[i] or 0.0, token_bytes=token.encode(),
            text_offset=logprobs.text_offset[i],
            top_logprobs=[pb.TopLogprob(token=t, logprob=lp, token_bytes=t.encode()) for t, lp in top.items()]))
    return entries


def chat_logprobs(logprobs: ChatLogprobs | None) -> list[pb.LogprobEntry]:
    if logprobs is None or logprobs.content is None:
        return []
    return [pb.LogprobEntry(token=e.token, logprob=e.logprob, token_bytes=bytes(e.bytes or e.token.encode()),
                            top_logprobs=[pb.TopLogprob(token=t.token, logprob=t.logprob,
                                                        token_bytes=bytes(t.bytes or t.token.encode()))
                                          for t in e.top_logprobs])
            for e in logprobs.content]


def completion_reply(response: CompletionResponse, tokens: TokenCursor) -> pb.CompleteResponse:
    """A completion (or one message of its stream); `tokens` supplies each choice's new token ids."""
    choices = [pb.CompletionChoice(index=c.index, text=c.text, logprobs=completion_logprobs(c.logprobs),
                                   finish_reason=finish_reason_to_proto(c.finish_reason),
                                   token_ids=tokens.take(c.index))
               for c in response.choices]
    return pb.CompleteResponse(id=response.id, created=response.created, model=response.model, choices=choices,
                               usage=usage(response.usage))


def chat_reply(response: ChatCompletionResponse | ChatCompletionChunk, tokens: TokenCursor) -> pb.ChatResponse:
    """A chat answer, or one message of its stream (deltas)."""
    choices = []
    for c in response.choices:
        message = c.message if isinstance(c, ChatChoice) else c.delta
        choices.append(pb.ChatChoice(index=c.index, role=message.role or "", content=message.content or "",
                                     logprobs=chat_logprobs(c.logprobs),
                                     finish_reason=finish_reason_to_proto(c.finish_reason),
                                     token_ids=tokens.take(c.index), tool_calls=_tool_calls(message),
                                     reasoning_content=message.reasoning_content or ""))
    return pb.ChatResponse(id=response.id, created=response.created, model=response.model, choices=choices,
                           usage=usage(response.usage))


def _tool_calls(message: AssistantMessage | Delta) -> list[pb.ToolCall]:
    """A whole answer's calls (indexed in order), or a stream message's call deltas."""
    if isinstance(message, AssistantMessage):
        return [pb.ToolCall(index=i, id=c.id, type=c.type, function=pb.FunctionCall(
            name=c.function.name, arguments=c.function.arguments)) for i, c in enumerate(message.tool_calls or [])]
    return [pb.ToolCall(index=d.index, id=d.id or "", type=d.type or "", function=pb.FunctionCall(
        name=d.function.name or "", arguments=d.function.arguments or "")) for d in message.tool_calls or []]


def model_reply(model: ModelObject) -> pb.Model:
    return pb.Model(id=model.id, created=model.created, owned_by=model.owned_by, root=model.root or "",
                    max_model_len=model.max_model_len or 0, parent=model.parent or "")
