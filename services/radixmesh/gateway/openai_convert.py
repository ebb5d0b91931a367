"""OpenAI request fields -> `SamplingParams`, and engine chunks -> OpenAI logprobs and usage."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from radixmesh.common.errors import RadixMeshError, invalid_argument, unsupported
from radixmesh.engine.grammar.spec import ANY_JSON
from radixmesh.gateway.backend import GatewayBackend, GenerationChunk, SamplingParams
from radixmesh.gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from radixmesh.gateway.tools.request import (
    ToolRequest,
    check_tools,
    message_calls,
    named_choice,
    tool_choice,
    tool_request,
    tool_spec,
)

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


@contextlib.contextmanager
def openai_names(renames: dict[str, str]) -> Iterator[None]:
    """Report engine parameter names (max_new_tokens, ...) under the names the client used."""
    try:
        yield
    except RadixMeshError as exc:
        if exc.param in renames:
            new = renames[exc.param]
            exc.message = exc.message.replace(exc.param, new)
            exc.param = new
        raise


def resolve_max_new_tokens(requested: int | None, prompt_len: int, context_len: int, default: int,
                           param: str, prompt_param: str) -> int:
    """The output budget: what was asked, else `default` clipped to the context end.

    An explicit value beyond the room the prompt leaves is refused (400 naming `param`), as OpenAI,
    vLLM and SGLang do: a silent clip would hide that the answer cannot be as long as asked.
    """
    if prompt_len >= context_len:
        raise invalid_argument(f"the prompt has {prompt_len} tokens, but the model's context length is "
                               f"{context_len} tokens; shorten the prompt", prompt_param)
    room = context_len - prompt_len
    if requested is None:
        return min(room, default)
    if requested < 1:
        raise invalid_argument(f"invalid {param}={requested}: must be >= 1", param)
    if requested > room:
        raise invalid_argument(f"{param}={requested} is too large: the prompt has {prompt_len} tokens and the "
                               f"context length is {context_len}, so at most {room} tokens can be generated",
                               param)
    return requested


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_new_tokens: int,
                    top_logprobs: int | None) -> SamplingParams:
    """`top_logprobs` None means no logprobs; 0 means the chosen tokens' logprobs only."""
    fields: dict[str, Any] = {"max_new_tokens": max_new_tokens, "n": req.n,
                                 "logprobs": top_logprobs is not None, "top_logprobs": top_logprobs or 0}
    optional = {
        "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "top_k": req.top_k, "min_p": req.min_p, "repetition_penalty": req.repetition_penalty,
        "min_new_tokens": req.min_tokens, "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
    }
    fields.update({name: value for name, value in optional.items() if value is not None})
    if req.stop is not None:
        fields["stop"] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    if req.stop_token_ids:
        fields["stop_token_ids"] = tuple(req.stop_token_ids)
    if req.logit_bias:
        fields["logit_bias"] = logit_bias(req.logit_bias)
    fields.update(grammar_fields(req))
    return SamplingParams(**fields)


def grammar_fields(req: CompletionRequest | ChatCompletionRequest) -> dict[str, str]:
    """`json_schema` / `regex` / `ebnf` of the engine from `response_format` and the SGLang extra fields.

    json_object is the built-in any-JSON grammar; json_schema constrains to its `schema` whether
    `strict` is true or not (a looser promise would be kept anyway). The syntax of each spec is
    checked when the request is validated, before admission.
    """
    fields: dict[str, str] = {}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        fields["json_schema"] = ANY_JSON
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise invalid_argument("response_format of type 'json_schema' needs json_schema.schema (a JSON Schema "
                                   "object)", "response_format")
        fields["json_schema"] = json.dumps(fmt.json_schema.schema_)
    elif fmt is not None and fmt.type == "structural_tag":
        if fmt.format is None:
            raise invalid_argument("response_format of type 'structural_tag' needs format (an xgrammar structural "
                                   "tag format)", "response_format")
        fields["structural_tag"] = json.dumps({"type": "structural_tag", "format": fmt.format})
    elif fmt is not None and fmt.type != "text":
        raise unsupported(f"response_format of type {fmt.type!r} is not supported; use text, json_object, "
                          "json_schema or structural_tag", "response_format")
    if fields and (req.json_schema is not None or req.regex is not None or req.ebnf is not None):
        raise invalid_argument("give either response_format or one of json_schema, regex and ebnf", "response_format")
    if req.json_schema is not None:
        fields["json_schema"] = req.json_schema if isinstance(req.json_schema, str) else json.dumps(req.json_schema)
    for name, value in (("regex", req.regex), ("ebnf", req.ebnf)):
        if value is not None:
            fields[name] = value
    return fields


def grammar_param_names(req: CompletionRequest | ChatCompletionRequest) -> dict[str, str]:
    """Errors about the engine's json_schema (or structural_tag) name `response_format` when that is what the
    client sent."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return {}
    return {"structural_tag": "response_format"} if fmt.type == "structural_tag" else {"json_schema": "response_format"}


def logit_bias(bias: dict[str, float]) -> dict[int, float]:
    try:
        return {int(token_id): float(value) for token_id, value in bias.items()}
    except ValueError:
        raise invalid_argument("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """{role, content} dicts for the chat template (text content parts joined by newlines), with an assistant
    turn's `tool_calls` and a tool turn's `tool_call_id` and `name`."""
    out = []
    for i, msg in enumerate(messages):
        role = CHAT_ROLES.get(msg.role)
        if role is None:
            raise unsupported(f"messages[{i}].role {msg.role!r} is not supported (use system, developer, user, "
                              "assistant or tool)", "messages")
        item: dict[str, Any] = {"role": role, "content": _text_content(msg, i)}
        if msg.tool_calls:
            if role != "assistant":
                raise invalid_argument(f"messages[{i}] has tool_calls, but only assistant messages make calls",
                                       "messages")
            calls = message_calls([(c.id, c.type, c.function.name, c.function.arguments) for c in msg.tool_calls],
                                  f"messages[{i}]")
            item["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]
        if role == "tool":
            if not msg.tool_call_id:
                raise invalid_argument(f"messages[{i}] has role 'tool' but no tool_call_id (the id of the call whose "
                                       "result it is)", "messages")
            item["tool_call_id"] = msg.tool_call_id
            if msg.name:
                item["name"] = msg.name
        out.append(item)
    return out


def chat_tools(req: ChatCompletionRequest) -> ToolRequest | None:
    """The request's tools and tool_choice, checked (None: the model answers in text)."""
    tools = []
    for i, tool in enumerate(req.tools or []):
        if tool.type != "function":
            raise invalid_argument(f"tools[{i}].type must be 'function' (got {tool.type!r})", "tools")
        f = tool.function
        tools.append(tool_spec(f.name, f.description, f.parameters, f"tools[{i}].function"))
    check_tools(tools)
    choice = req.tool_choice
    named = named_choice(choice) if isinstance(choice, dict) else None
    mode = choice if isinstance(choice, str) else None
    return tool_request(tools, tool_choice(mode, named, tools), req.parallel_tool_calls)


def _text_content(msg: ChatMessage, i: int) -> str:
    if msg.content is None or isinstance(msg.content, str):
        return msg.content or ""
    texts = []
    for part in msg.content:
        if part.type != "text" or part.text is None:
            raise unsupported(f"messages[{i}] has a content part of type {part.type!r}; only text is supported",
                              "messages")
        texts.append(part.text)
    return "\n".join(texts)


def check_chat_supported(req: ChatCompletionRequest) -> None:
    if req.functions:
        raise unsupported("functions (the legacy API) is not supported; use tools", "functions")
    if req.top_logprobs and not req.logprobs:
        raise invalid_argument("top_logprobs needs logprobs set to true", "top_logprobs")


def check_completion_supported(req: CompletionRequest) -> None:
    if req.suffix:
        raise unsupported("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise unsupported("best_of other than n is not supported", "best_of")
    if req.echo and req.logprobs is not None:
        raise unsupported("echo with logprobs needs prompt logprobs, which are not supported", "echo")


# ---- results -------------------------------------------------------------------------------------
@dataclass
class ChoiceState:
    """What one choice (sequence) has produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    input_logprobs: list[float | None] = field(default_factory=list)
    """Prompt-token log-probs from `logprob_start_len` on (None for the prompt's first token)."""
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)

    def add(self, chunk: GenerationChunk) -> None:
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs or []
        self.top_logprobs += chunk.top_logprobs or []
        self.input_logprobs += chunk.input_logprobs or []
        self.input_top_logprobs += chunk.input_top_logprobs or []
        self.prompt_tokens, self.cached_tokens = chunk.prompt_tokens, chunk.cached_tokens
        self.completion_tokens = chunk.completion_tokens
        if chunk.finish_reason is not None:
            self.finish_reason, self.matched_stop = chunk.finish_reason, chunk.matched_stop


def usage(states: list[ChoiceState], n: int) -> Usage:
    """Prompts count once per prompt (not per branch); cached tokens are the least any branch reused."""
    prompt = cached = 0
    for start in range(0, len(states), n):
        branches = states[start:start + n]
        prompt += branches[0].prompt_tokens
        cached += min(s.cached_tokens for s in branches)
    completion = sum(s.completion_tokens for s in states)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def completion_logprobs(backend: GatewayBackend, token_ids: list[int], logprobs: list[float],
                        top: list[list[tuple[int, float]]], text_offset: int) -> CompletionLogprobs:
    """Legacy completions shape; `text_offset` is where these tokens start in the choice's text."""
    texts = _texts(backend, token_ids, top)
    out = CompletionLogprobs()
    for i, token_id in enumerate(token_ids):
        out.tokens.append(texts[token_id])
        out.token_logprobs.append(logprobs[i] if i < len(logprobs) else None)
        out.top_logprobs.append({texts[t]: lp for t, lp in top[i]} if i < len(top) else None)
        out.text_offset.append(text_offset)
        text_offset += len(texts[token_id])
    return out


def chat_logprobs(backend: GatewayBackend, token_ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]]) -> list[TokenLogprob]:
    texts = _texts(backend, token_ids, top)
    out = []
    for i, token_id in enumerate(token_ids):
        alternatives = [TopLogprob(token=texts[t], logprob=lp, bytes=list(texts[t].encode()))
                        for t, lp in (top[i] if i < len(top) else [])]
        out.append(TokenLogprob(token=texts[token_id], logprob=logprobs[i] if i < len(logprobs) else 0.0,
                                bytes=list(texts[token_id].encode()), top_logprobs=alternatives))
    return out


def _texts(backend: GatewayBackend, token_ids: list[int], top: list[list[tuple[int, float]]]) -> dict[int, str]:
    ids = sorted(set(token_ids) | {t for row in top for t, _ in row})
    return dict(zip(ids, backend.token_texts(ids)))
