"""Typed bodies of OpenAI's Responses API (/v1/responses), stateless: the request carries the whole
conversation (`input` items), nothing is stored and `previous_response_id` is refused."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from radixmesh.gateway.protocol import RequestBody, SamplingExtensions


class ResponsesRequest(SamplingExtensions):
    model: str | None = None
    input: str | list[dict[str, Any]]
    """A user message's text, or items: messages, function_call and function_call_output (reasoning items are
    skipped: thinking is not fed back)."""
    instructions: str | None = None
    """A system message before the input."""
    tools: list[dict[str, Any]] | None = None
    """`{"type": "function", "name", "description", "parameters", "strict"}` entries."""
    tool_choice: str | dict[str, Any] | None = None
    """auto | none | required | `{"type": "function", "name": ...}`."""
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    """Accepted and ignored: nothing is stored (the response says `store: false`)."""
    text: TextConfig | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    include_reasoning: bool = True
    """With a reasoning parser: false leaves the reasoning item out."""
    metadata: dict[str, str] | None = None


class TextFormat(RequestBody):
    type: str
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(RequestBody):
    format: TextFormat | None = None


ResponsesRequest.model_rebuild()


# ---- the response -----------------------------------------------------------------------------------
class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponsesUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    """The response; `output` items are dicts in the API's shapes (reasoning, message, function_call)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    usage: ResponsesUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    store: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
