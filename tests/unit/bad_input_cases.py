"""Malformed requests and the error each must get: one table for the HTTP API (OpenAI and native) and
one for the worker's gRPC Generate, shared by the unit tests (fake backend, in-process) and the
integration tests (real processes on the default model).

A body may depend on the served model's context length (`ctx`): such bodies are functions of it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixmesh.protocol import sampling_pb2

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GENERATE = "/generate"
HUGE_ID = 10**9
"""A token id beyond any vocabulary."""
EXPLODING_REGEX = ".?" * 64
"""Compiles for minutes in xgrammar (each optional any-character doubles back); refused up front."""
MiB = 1 << 20

Body = dict[str, Any] | bytes | Callable[[int], dict[str, Any] | bytes]


@dataclass(frozen=True)
class HttpCase:
    """One malformed HTTP request: `param` is the error's expected `param` (None where the whole body
    is at fault) and `mention` a text the message must contain (default: the param)."""

    id: str
    path: str
    body: Body
    param: str | None
    mention: str = ""
    status: int = 400

    def payload(self, ctx: int) -> bytes:
        body = self.body(ctx) if callable(self.body) else self.body
        return body if isinstance(body, bytes) else json.dumps(body).encode()

    @property
    def expected_text(self) -> str:
        return self.mention or self.param or ""


def _completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Hello", "max_tokens": 2, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def _generate(sampling: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    return {"text": "Hello", "sampling_params": {"max_new_tokens": 2, **(sampling or {})}, **fields}


def nested_schema(levels: int) -> dict[str, Any]:
    """An object schema `levels` properties deep (three JSON levels per schema level)."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


RECURSIVE_SCHEMA = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
STOP_10K = [f"stop-{i}" for i in range(10_000)]
BIAS_5K = {str(i): 1.0 for i in range(5_000)}


def _deep_list(levels: int) -> bytes:
    return b'{"messages": ' + b"[" * levels + b"]" * levels + b"}"


COMPLETION_CASES = [
    HttpCase("c-prompt-longer-than-context", COMPLETIONS, lambda ctx: _completion(prompt="hello " * (ctx + 10)),
             "prompt", "context length"),
    HttpCase("c-max-tokens-zero", COMPLETIONS, _completion(max_tokens=0), "max_tokens"),
    HttpCase("c-max-tokens-negative", COMPLETIONS, _completion(max_tokens=-5), "max_tokens"),
    HttpCase("c-max-tokens-enormous", COMPLETIONS, _completion(max_tokens=10**12), "max_tokens"),
    HttpCase("c-max-tokens-string", COMPLETIONS, _completion(max_tokens="many"), "max_tokens"),
    HttpCase("c-max-tokens-float", COMPLETIONS, _completion(max_tokens=2.5), "max_tokens"),
    HttpCase("c-n-zero", COMPLETIONS, _completion(n=0), "n"),
    HttpCase("c-n-1000", COMPLETIONS, _completion(n=1000), "n"),
    HttpCase("c-logprobs-negative", COMPLETIONS, _completion(logprobs=-1), "logprobs"),
    HttpCase("c-logprobs-too-many", COMPLETIONS, _completion(logprobs=21), "logprobs"),
    HttpCase("c-stop-10000-strings", COMPLETIONS, _completion(stop=STOP_10K), "stop"),
    HttpCase("c-stop-string-too-long", COMPLETIONS, _completion(stop=["x" * 5000]), "stop"),
    HttpCase("c-logit-bias-5000-entries", COMPLETIONS, _completion(logit_bias=BIAS_5K), "logit_bias"),
    HttpCase("c-logit-bias-key-not-id", COMPLETIONS, _completion(logit_bias={"abc": 1.0}), "logit_bias"),
    HttpCase("c-logit-bias-id-out-of-vocab", COMPLETIONS, _completion(logit_bias={str(HUGE_ID): 1.0}), "logit_bias"),
    HttpCase("c-logit-bias-value-out-of-range", COMPLETIONS, _completion(logit_bias={"5": 1000.0}), "logit_bias"),
    HttpCase("c-prompt-object", COMPLETIONS, _completion(prompt={"text": "Hello"}), "prompt"),
    HttpCase("c-prompt-empty-list", COMPLETIONS, _completion(prompt=[]), "prompt"),
    HttpCase("c-prompt-empty-token-list", COMPLETIONS, _completion(prompt=[[]]), "prompt"),
    HttpCase("c-prompt-negative-token-id", COMPLETIONS, _completion(prompt=[-1, 5]), "prompt"),
    HttpCase("c-prompt-token-id-out-of-vocab", COMPLETIONS, _completion(prompt=[HUGE_ID]), "prompt"),
    HttpCase("c-temperature-list", COMPLETIONS, _completion(temperature=[1.0]), "temperature"),
    HttpCase("c-temperature-negative", COMPLETIONS, _completion(temperature=-1.0), "temperature"),
    HttpCase("c-top-p-above-one", COMPLETIONS, _completion(top_p=1.5), "top_p"),
    HttpCase("c-top-k-enormous", COMPLETIONS, _completion(top_k=10**15), "top_k"),
    HttpCase("c-seed-beyond-int64", COMPLETIONS, _completion(seed=2**64), "seed"),
    HttpCase("c-model-int", COMPLETIONS, _completion(model=123), "model"),
    HttpCase("c-stream-string", COMPLETIONS, _completion(stream="yes"), "stream"),
    HttpCase("c-regex-that-explodes", COMPLETIONS, _completion(regex=EXPLODING_REGEX), "regex", "too complex"),
    HttpCase("c-prompt-lone-surrogate", COMPLETIONS,
             b'{"prompt": "caf\\ud800", "max_tokens": 2}', "prompt", "surrogate"),
    HttpCase("c-unknown-key-lone-surrogate", COMPLETIONS, b'{"\\udc00": 1, "prompt": "Hi", "max_tokens": 2}',
             "\\udc00", "surrogate"),
    HttpCase("c-invalid-utf8", COMPLETIONS, b'{"prompt": "caf\xc3\x28\xff", "max_tokens": 2}', None, "UTF-8"),
    HttpCase("c-body-10mb", COMPLETIONS, json.dumps(_completion(prompt="a" * (10 * MiB))).encode(), None,
             "larger than", status=413),
    HttpCase("c-empty-body", COMPLETIONS, b"", None, "not valid JSON"),
    HttpCase("c-suffix-unsupported", COMPLETIONS, _completion(suffix="!"), "suffix"),
]

CHAT_CASES = [
    HttpCase("chat-messages-empty", CHAT, _chat(messages=[]), "messages"),
    HttpCase("chat-messages-object", CHAT, _chat(messages={"role": "user", "content": "Hi"}), "messages"),
    HttpCase("chat-message-without-role", CHAT, _chat(messages=[{"content": "Hi"}]), "messages", "role"),
    HttpCase("chat-message-unknown-role", CHAT, _chat(messages=[{"role": "wizard", "content": "Hi"}]), "messages",
             "wizard"),
    HttpCase("chat-message-content-int", CHAT, _chat(messages=[{"role": "user", "content": 5}]), "messages",
             "content"),
    HttpCase("chat-message-image-part", CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), "messages[0].content[0].image_url",
             "does not take images"),
    HttpCase("chat-prompt-longer-than-context", CHAT,
             lambda ctx: _chat(messages=[{"role": "user", "content": "hello " * (ctx + 10)}]), "messages",
             "context length"),
    HttpCase("chat-max-tokens-string", CHAT, _chat(max_tokens="many"), "max_tokens"),
    HttpCase("chat-max-completion-tokens-zero", CHAT, _chat(max_completion_tokens=0), "max_completion_tokens"),
    HttpCase("chat-max-tokens-beyond-context", CHAT, lambda ctx: _chat(max_tokens=ctx), "max_tokens",
             "context length"),
    HttpCase("chat-n-1000", CHAT, _chat(n=1000), "n"),
    HttpCase("chat-n-string", CHAT, _chat(n="2"), "n"),
    HttpCase("chat-top-logprobs-50", CHAT, _chat(logprobs=True, top_logprobs=50), "top_logprobs"),
    HttpCase("chat-top-logprobs-negative", CHAT, _chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
    HttpCase("chat-top-logprobs-without-logprobs", CHAT, _chat(top_logprobs=5), "top_logprobs"),
    HttpCase("chat-logprobs-string", CHAT, _chat(logprobs="yes"), "logprobs"),
    HttpCase("chat-temperature-nan", CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, '
             b'"temperature": NaN}', "temperature"),
    HttpCase("chat-frequency-penalty-out-of-range", CHAT, _chat(frequency_penalty=5.0), "frequency_penalty"),
    HttpCase("chat-stop-int", CHAT, _chat(stop=5), "stop"),
    HttpCase("chat-stop-empty-string", CHAT, _chat(stop=[""]), "stop"),
    HttpCase("chat-logit-bias-list", CHAT, _chat(logit_bias=[1, 2]), "logit_bias"),
    HttpCase("chat-model-list", CHAT, _chat(model=["a", "b"]), "model"),
    HttpCase("chat-stream-options-string", CHAT, _chat(stream=True, stream_options="usage"), "stream_options"),
    HttpCase("chat-response-format-schema-missing", CHAT, _chat(response_format={"type": "json_schema"}),
             "response_format"),
    HttpCase("chat-response-format-unknown-type", CHAT, _chat(response_format={"type": "xml"}), "response_format"),
    HttpCase("chat-response-format-schema-too-deep", CHAT, _chat(response_format={
        "type": "json_schema", "json_schema": {"name": "deep", "schema": nested_schema(40)}}), "response_format",
             "nested"),
    HttpCase("chat-response-format-schema-recursive", CHAT, _chat(response_format={
        "type": "json_schema", "json_schema": {"name": "loop", "schema": RECURSIVE_SCHEMA}}), "response_format",
             "cycle"),
    HttpCase("chat-json-schema-body-nested-too-deep", CHAT, _chat(json_schema=nested_schema(60)), "json_schema",
             "nested"),
    HttpCase("chat-body-nested-100000-levels", CHAT, _deep_list(100_000), None, "nested too deeply"),
    HttpCase("chat-body-not-json", CHAT, b"{not json", None, "not valid JSON"),
]

GENERATE_CASES = [
    HttpCase("gen-text-and-input-ids", GENERATE, _generate(input_ids=[1, 2]), "text"),
    HttpCase("gen-neither-text-nor-input-ids", GENERATE, {"sampling_params": {"max_new_tokens": 2}}, "text"),
    HttpCase("gen-text-int", GENERATE, _generate(text=5), "text"),
    HttpCase("gen-input-ids-empty", GENERATE, {"input_ids": [], "sampling_params": {"max_new_tokens": 2}},
             "input_ids"),
    HttpCase("gen-input-ids-strings", GENERATE, {"input_ids": ["a", "b"]}, "input_ids"),
    HttpCase("gen-input-ids-negative", GENERATE, {"input_ids": [-1, 3], "sampling_params": {"max_new_tokens": 2}},
             "input_ids"),
    HttpCase("gen-input-ids-out-of-vocab", GENERATE, {"input_ids": [HUGE_ID], "sampling_params": {
        "max_new_tokens": 2}}, "input_ids"),
    HttpCase("gen-input-ids-longer-than-context", GENERATE,
             lambda ctx: {"input_ids": [1] * (ctx + 5), "sampling_params": {"max_new_tokens": 2}}, "input_ids",
             "context length"),
    HttpCase("gen-sampling-params-string", GENERATE, _generate() | {"sampling_params": "greedy"}, "sampling_params"),
    HttpCase("gen-max-new-tokens-negative", GENERATE, _generate({"max_new_tokens": -1}), "max_new_tokens"),
    HttpCase("gen-max-new-tokens-enormous", GENERATE, _generate({"max_new_tokens": 10**12}), "max_new_tokens"),
    HttpCase("gen-max-new-tokens-string", GENERATE, _generate({"max_new_tokens": "8"}), "sampling_params",
             "max_new_tokens"),
    HttpCase("gen-temperature-list", GENERATE, _generate({"temperature": [0.5]}), "sampling_params", "temperature"),
    HttpCase("gen-n-1000", GENERATE, _generate({"n": 1000}), "n"),
    HttpCase("gen-top-logprobs-num-1000", GENERATE, _generate(return_logprob=True, top_logprobs_num=1000),
             "top_logprobs_num"),
    HttpCase("gen-logprob-start-len-negative", GENERATE, _generate(return_logprob=True, logprob_start_len=-5),
             "logprob_start_len"),
    HttpCase("gen-logprob-start-len-beyond-int32", GENERATE, _generate(return_logprob=True, logprob_start_len=2**40),
             "logprob_start_len"),
    HttpCase("gen-stop-10000-strings", GENERATE, _generate({"stop": STOP_10K}), "stop"),
    HttpCase("gen-stop-token-ids-out-of-vocab", GENERATE, _generate({"stop_token_ids": [HUGE_ID]}), "stop_token_ids"),
    HttpCase("gen-logit-bias-5000-entries", GENERATE, _generate({"logit_bias": BIAS_5K}), "logit_bias"),
    HttpCase("gen-regex-that-explodes", GENERATE, _generate({"regex": EXPLODING_REGEX}), "regex", "too complex"),
    HttpCase("gen-regex-invalid", GENERATE, _generate({"regex": "[a-"}), "regex"),
    HttpCase("gen-ebnf-invalid", GENERATE, _generate({"ebnf": "root ::= ("}), "ebnf"),
    HttpCase("gen-json-schema-too-deep", GENERATE, _generate({"json_schema": json.dumps(nested_schema(40))}),
             "json_schema", "nested"),
    HttpCase("gen-json-schema-self-reference", GENERATE, _generate({"json_schema": '{"$ref": "#"}'}), "json_schema",
             "cycle"),
    HttpCase("gen-json-schema-not-json", GENERATE, _generate({"json_schema": "{type: object"}), "json_schema"),
    HttpCase("gen-two-grammars", GENERATE, _generate({"regex": "a+", "ebnf": 'root ::= "a"'}), "ebnf"),
    HttpCase("gen-sampling-params-count-mismatch", GENERATE, {"text": ["a", "b"], "sampling_params": [
        {"max_new_tokens": 2}]}, "sampling_params"),
    HttpCase("gen-image-data-unsupported", GENERATE, _generate(image_data="http://x/cat.png"), "image_data",
             "does not take images"),
    HttpCase("gen-body-json-array", GENERATE, b"[1, 2, 3]", None, "JSON object"),
]

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _tool_turns(*turns: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Weather in Paris?"}, *turns]


def _called(**function: Any) -> list[dict[str, Any]]:
    """A conversation whose assistant turn made one call with these `function` fields."""
    return _tool_turns({"role": "assistant", "tool_calls": [{**CALL, "function": function}]})


TOOL_CASES = [
    HttpCase("tools-not-a-list", CHAT, _chat(tools={"type": "function"}), "tools"),
    HttpCase("tools-entry-not-object", CHAT, _chat(tools=["get_weather"]), "tools"),
    HttpCase("tools-type-unknown", CHAT, _chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools",
             "'function'"),
    HttpCase("tools-function-missing", CHAT, _chat(tools=[{"type": "function"}]), "tools", "function"),
    HttpCase("tools-name-missing", CHAT, _chat(tools=[{"type": "function", "function": {}}]), "tools", "name"),
    HttpCase("tools-name-not-string", CHAT, _chat(tools=[{"type": "function", "function": {"name": 5}}]), "tools",
             "name"),
    HttpCase("tools-name-with-spaces", CHAT, _chat(tools=[{"type": "function", "function": {"name": "get weather"}}]),
             "tools", "letters, digits"),
    HttpCase("tools-name-too-long", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f" * 65}}]),
             "tools", "64"),
    HttpCase("tools-duplicate-name", CHAT, _chat(tools=[WEATHER, WEATHER]), "tools", "twice"),
    HttpCase("tools-parameters-not-object", CHAT, _chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": "city"}}]), "tools", "parameters"),
    HttpCase("tools-parameters-not-object-schema", CHAT, _chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]), "tools", "object"),
    HttpCase("tools-parameters-invalid-schema", CHAT, _chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}]), "tools",
             "tools[0].function.parameters"),
    HttpCase("tools-description-not-string", CHAT, _chat(tools=[{"type": "function", "function": {
        "name": "f", "description": 3}}]), "tools", "description"),
    HttpCase("tool-choice-unknown", CHAT, _chat(tools=[WEATHER], tool_choice="always"), "tool_choice", "always"),
    HttpCase("tool-choice-int", CHAT, _chat(tools=[WEATHER], tool_choice=1), "tool_choice"),
    HttpCase("tool-choice-function-not-in-tools", CHAT, _chat(tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_time"}}), "tool_choice", "get_time"),
    HttpCase("tool-choice-function-without-tools", CHAT, _chat(tool_choice={
        "type": "function", "function": {"name": "get_time"}}), "tool_choice", "no tools"),
    HttpCase("tool-choice-required-without-tools", CHAT, _chat(tool_choice="required"), "tool_choice", "needs tools"),
    HttpCase("tool-choice-name-not-string", CHAT, _chat(tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": ["get_weather"]}}), "tool_choice", "name"),
    HttpCase("tool-choice-type-unknown", CHAT, _chat(tools=[WEATHER], tool_choice={
        "type": "tool", "function": {"name": "get_weather"}}), "tool_choice", "'function'"),
    HttpCase("tool-choice-required-with-response-format", CHAT, _chat(tools=[WEATHER], tool_choice="required",
                                                                      response_format={"type": "json_object"}),
             "tool_choice", "response_format"),
    HttpCase("parallel-tool-calls-string", CHAT, _chat(tools=[WEATHER], parallel_tool_calls="no"),
             "parallel_tool_calls"),
    HttpCase("tool-message-without-tool-call-id", CHAT, _chat(messages=_tool_turns(
        {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "sunny"})), "messages",
             "tool_call_id"),
    HttpCase("tool-message-tool-call-id-int", CHAT, _chat(messages=_tool_turns(
        {"role": "tool", "tool_call_id": 7, "content": "sunny"})), "messages", "tool_call_id"),
    HttpCase("assistant-tool-call-arguments-not-json", CHAT, _chat(messages=_called(
        name="get_weather", arguments="{city: Paris")), "messages", "not valid JSON"),
    HttpCase("assistant-tool-call-arguments-object", CHAT, _chat(messages=_called(
        name="get_weather", arguments={"city": "Paris"})), "messages", "arguments"),
    HttpCase("assistant-tool-call-arguments-list", CHAT, _chat(messages=_called(name="get_weather", arguments="[1]")),
             "messages", "JSON object"),
    HttpCase("assistant-tool-call-without-id", CHAT, _chat(messages=_tool_turns({"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]})), "messages", "id"),
    HttpCase("assistant-tool-call-name-not-string", CHAT, _chat(messages=_called(name=3, arguments="{}")), "messages",
             "name"),
    HttpCase("user-message-with-tool-calls", CHAT, _chat(messages=[{"role": "user", "content": "hi", "tool_calls": [
        CALL]}]), "messages", "only assistant"),
    HttpCase("chat-functions-legacy", CHAT, _chat(functions=[{"name": "f"}]), "functions"),
]

HTTP_CASES = COMPLETION_CASES + CHAT_CASES + TOOL_CASES + GENERATE_CASES
GOOD_REQUESTS = [(COMPLETIONS, _completion()), (CHAT, _chat()), (GENERATE, _generate()), (CHAT, _chat(model="default"))]
"""One well-formed request per endpoint: each must still succeed after the malformed ones."""


def check_http_error(case: HttpCase, status: int, body: dict[str, Any]) -> None:
    """The OpenAI error shape, the expected status, and the field named."""
    assert status == case.status, (case.id, status, body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], (case.id, body)
    assert error["type"] == "invalid_request_error", (case.id, body)
    assert error["param"] == case.param, (case.id, error)
    assert case.expected_text in error["message"], (case.id, error)


# ---- gRPC: the worker's Generate ---------------------------------------------------------------------------
@dataclass(frozen=True)
class GrpcCase:
    """A malformed worker GenerateRequest (token ids + proto sampling params) and the param it must name."""

    id: str
    token_ids: list[int] | Callable[[int], list[int]]
    params: sampling_pb2.SamplingParams
    param: str
    mention: str = ""

    def ids(self, ctx: int) -> list[int]:
        return self.token_ids(ctx) if callable(self.token_ids) else self.token_ids


def _sp(**fields: Any) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(max_new_tokens=fields.pop("max_new_tokens", 2), **fields)


PROMPT = [1, 2, 3, 4]
GRPC_CASES = [
    GrpcCase("grpc-empty-token-ids", [], _sp(), "prompt", "empty"),
    GrpcCase("grpc-token-id-out-of-vocab", [1, HUGE_ID], _sp(), "input_ids"),
    GrpcCase("grpc-prompt-longer-than-context", lambda ctx: [1] * (ctx + 1), _sp(), "prompt", "context length"),
    GrpcCase("grpc-max-new-tokens-zero", PROMPT, _sp(max_new_tokens=0), "max_new_tokens"),
    GrpcCase("grpc-max-new-tokens-uint32-max", PROMPT, _sp(max_new_tokens=2**32 - 1), "max_new_tokens",
             "context length"),
    GrpcCase("grpc-min-new-tokens-above-max", PROMPT, _sp(min_new_tokens=5), "min_new_tokens"),
    GrpcCase("grpc-temperature-negative", PROMPT, _sp(temperature=-1.0), "temperature"),
    GrpcCase("grpc-temperature-nan", PROMPT, _sp(temperature=math.nan), "temperature"),
    GrpcCase("grpc-top-p-zero", PROMPT, _sp(top_p=0.0), "top_p"),
    GrpcCase("grpc-top-k-negative", PROMPT, _sp(top_k=-5), "top_k"),
    GrpcCase("grpc-repetition-penalty-zero", PROMPT, _sp(repetition_penalty=0.0), "repetition_penalty"),
    GrpcCase("grpc-n-two", PROMPT, _sp(n=2), "n"),
    GrpcCase("grpc-top-logprobs-1000", PROMPT, _sp(logprobs=True, top_logprobs=1000), "top_logprobs"),
    GrpcCase("grpc-logprob-start-len-negative", PROMPT, _sp(logprob_start_len=-3), "logprob_start_len"),
    GrpcCase("grpc-seed-int64-max", PROMPT, _sp(seed=2**63 - 1), "seed"),
    GrpcCase("grpc-stop-10000-strings", PROMPT, _sp(stop=STOP_10K), "stop"),
    GrpcCase("grpc-stop-token-id-out-of-vocab", PROMPT, _sp(stop_token_ids=[HUGE_ID]), "stop_token_ids"),
    GrpcCase("grpc-logit-bias-out-of-vocab", PROMPT, _sp(logit_bias={HUGE_ID: 1.0}), "logit_bias"),
    GrpcCase("grpc-logit-bias-5000-entries", PROMPT, _sp(logit_bias={i: 1.0 for i in range(5000)}), "logit_bias"),
    GrpcCase("grpc-regex-invalid", PROMPT, _sp(regex="[a-"), "regex"),
    GrpcCase("grpc-regex-that-explodes", PROMPT, _sp(regex=EXPLODING_REGEX), "regex", "too complex"),
    GrpcCase("grpc-json-schema-too-deep", PROMPT, _sp(json_schema=json.dumps(nested_schema(40))), "json_schema",
             "nested"),
    GrpcCase("grpc-json-schema-recursive", PROMPT, _sp(json_schema=json.dumps(RECURSIVE_SCHEMA)), "json_schema",
             "cycle"),
    GrpcCase("grpc-two-grammars", PROMPT, _sp(json_schema='{"type": "object"}', regex="a+"), "regex"),
]
