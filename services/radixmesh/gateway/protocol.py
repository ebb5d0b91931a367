"""Typed OpenAI request and response bodies (pydantic).

Requests ignore unknown fields (`extra="ignore"`): OpenAI clients send fields such as
`user`, `store`, `metadata` or `service_tier` that do not change what is generated.
Fields that would change the output but are not supported (`functions`, `suffix`,
`response_format` types other than text / json_object / json_schema / structural_tag) are declared
so the handlers can reject them by name.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, ValidationError, model_serializer

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.grammar.spec import json_depth
from radixmesh.gateway import request_trace

M = TypeVar("M", bound=BaseModel)


MAX_JSON_DEPTH = 128
"""Deepest nesting of arrays and objects in a request body (a JSON schema inside it has its own, lower cap)."""
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def parse_body(raw: bytes, model: type[M]) -> M:
    """Parse and validate a JSON request body; failures are 400s naming the field.

    Types are checked strictly, as OpenAI does: `"16"` is not an integer and `"yes"` not a boolean
    (integers are accepted where numbers are expected).
    """
    request_trace.mark("t_body")
    try:
        data = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise invalid_argument(f"the request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    except ValueError as exc:
        raise invalid_argument(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid_argument(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    if not isinstance(data, dict):
        raise invalid_argument("the request body must be a JSON object")
    _check_json_values(raw, data)
    return validate_data(data, model)


def validate_data(data: dict[str, Any], model: type[M]) -> M:
    """Validate a request already decoded (from JSON or from protobuf); failures are 400s naming the field."""
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(part) for part in first["loc"]]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        raise invalid_argument(f"invalid '{where}': {first['msg']}", param) from None


def _check_json_values(raw: bytes, data: dict[str, Any]) -> None:
    """Depth within MAX_JSON_DEPTH, and no lone UTF-16 surrogates (`"\\ud800"`): they are valid JSON
    escapes but not text, and would fail deep inside the tokenizer."""
    for key, value in data.items():
        if json_depth(value) >= MAX_JSON_DEPTH:
            raise invalid_argument(f"'{key}' is nested too deeply (at most {MAX_JSON_DEPTH} levels)", key)
    if _SURROGATE_ESCAPE.search(raw) is None:
        return
    for key, value in data.items():
        if _has_lone_surrogate(key) or _has_lone_surrogate(value):
            raise invalid_argument(f"'{key}' contains an unpaired UTF-16 surrogate escape; text must be valid "
                                   "Unicode", key)


def _has_lone_surrogate(value: object) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(RequestBody):
    include_usage: bool = False


class SamplingExtensions(RequestBody):
    """Sampling fields of vLLM and SGLang that OpenAI lacks, accepted on both OpenAI endpoints."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    # structured outputs, as SGLang accepts them (a JSON schema also as an object)
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None


class CompletionRequest(SamplingExtensions):
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    """Token ids before text lists: a union member that fails checks every element, and ids are the long prompts."""
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    echo: bool = False
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None


class ImageURL(RequestBody):
    url: str
    detail: str | None = None


class ContentPart(RequestBody):
    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None
    """`type: image_url`: a base64 data: URL (http(s) where the server allows it), as OpenAI sends it."""


class FunctionCallBody(RequestBody):
    name: str
    arguments: str
    """JSON text of the arguments object, as the model wrote it."""


class MessageToolCall(RequestBody):
    """A call an assistant turn made (from an earlier response's `tool_calls`)."""

    id: str
    type: str = "function"
    function: FunctionCallBody


class ChatMessage(RequestBody):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    """A `tool` turn: the id of the call whose result this is."""
    name: str | None = None


class FunctionDefinition(RequestBody):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """JSON Schema of the arguments (an object); absent: the function takes none."""
    strict: bool | None = None


class ToolDefinition(RequestBody):
    type: str
    function: FunctionDefinition


class JsonSchemaFormat(RequestBody):
    """OpenAI's `response_format.json_schema`; the output follows `schema` whether or not `strict` is set."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestBody):
    type: str
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    """`type: structural_tag`: the structural tag's format (xgrammar's, as SGLang takes it)."""


class ChatCompletionRequest(SamplingExtensions):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    seed: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    """auto | none | required | `{"type": "function", "function": {"name": ...}}`; absent: auto with tools, none
    without (checked by the tools module, whose messages name the part at fault)."""
    parallel_tool_calls: bool | None = None
    """False: at most one call per answer (default true)."""
    functions: list[Any] | None = None
    include_reasoning: bool = True
    """With a reasoning parser: false drops the reasoning (`reasoning_content`) from the answer."""
    separate_reasoning: bool = True
    """With a reasoning parser: false leaves the reasoning in `content`, unparsed (SGLang's option)."""


# ---- responses ----------------------------------------------------------------------------------
class Response(BaseModel):
    pass


class PromptTokensDetails(Response):
    cached_tokens: int = 0


class Usage(Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(Response):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(Response):
    name: str
    arguments: str


class ToolCallOut(Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(Response):
    """`reasoning_content` and `tool_calls` are sent only when the answer has them."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items()
                if value is not None or key not in ("reasoning_content", "tool_calls")}


class ChatChoice(Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(Response):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ToolCallDelta(Response):
    """A call's first delta has its id, type and name (arguments ""); later ones only more arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class Delta(Response):
    """Only the fields a chunk carries are sent (role on the first, content after it)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(Response):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelObject(Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "radixmesh"
    root: str | None = None
    parent: str | None = None
    """A LoRA adapter's base model (None for the base model itself)."""
    max_model_len: int | None = None


class ModelList(Response):
    object: Literal["list"] = "list"
    data: list[ModelObject]
