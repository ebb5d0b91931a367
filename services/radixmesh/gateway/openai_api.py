"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any, cast

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from radixmesh.common.errors import invalid_argument, not_found, unsupported
from radixmesh.engine.mm.prompt import PromptWithImages
from radixmesh.gateway import openai_convert as conv
from radixmesh.gateway.backend import GenerationChunk
from radixmesh.gateway.dispatch import Generation, PromptJob
from radixmesh.gateway.images import chat_with_images, has_images
from radixmesh.gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    FunctionCallDelta,
    FunctionCallOut,
    ModelList,
    ModelObject,
    ToolCallDelta,
    ToolCallOut,
    parse_body,
)
from radixmesh.gateway.sse import DONE, EventStreamResponse, event, with_error_events
from radixmesh.gateway.state import GatewayState, get_state, unless_disconnected
from radixmesh.gateway.tools.chat import ChatSetup
from radixmesh.gateway.tools.stream import CallDelta

router = APIRouter(prefix="/v1", tags=["openai"])

_COMPLETION_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "top_logprobs": "logprobs",
                     "input_ids": "prompt"}


def _json(model: CompletionResponse | ChatCompletionResponse | ModelList | ModelObject) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


# ---- models --------------------------------------------------------------------------------------
def model_object(state: GatewayState) -> ModelObject:
    card = state.backend.card
    return ModelObject(id=card.name, created=card.created, root=card.model_path or card.name,
                       max_model_len=card.context_len)


def adapter_objects(state: GatewayState, adapters: list[dict[str, Any]]) -> list[ModelObject]:
    """LoRA adapters as models: id "adapter", parent the base model (vLLM's way)."""
    card = state.backend.card
    return [ModelObject(id=a["name"], created=card.created, root=str(a.get("path") or a["name"]), parent=card.name,
                        max_model_len=card.context_len) for a in adapters]


@router.get("/models")
async def list_models(request: Request) -> Response:
    state = get_state(request)
    adapters = await state.backend.list_lora_adapters() if state.backend.card.serves_lora else []
    return _json(ModelList(data=[model_object(state), *adapter_objects(state, adapters)]))


@router.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> Response:
    state = get_state(request)
    _, lora = state.resolve_model_adapter(model_id)
    if lora is None:
        return _json(model_object(state))
    found = [a for a in await state.backend.list_lora_adapters() if a["name"] == lora]
    if not found:
        raise not_found(f"The model '{model_id}' does not exist: no LoRA adapter {lora!r} is loaded", "model")
    return _json(adapter_objects(state, found)[0])


# ---- completions ---------------------------------------------------------------------------------
@router.post("/completions")
async def completions(request: Request) -> Response:
    state = get_state(request)
    run = await start_completion(state, parse_body(await request.body(), CompletionRequest))
    return await _respond(request, run, run.req.stream)


async def start_completion(state: GatewayState, req: CompletionRequest) -> CompletionRun:
    """Validate and admit a completion request (HTTP and gRPC alike); the run is not started yet."""
    model, lora = state.resolve_model_adapter(req.model)
    model = req.model if lora is not None and req.model else model  # a fine-tune answers under its own name
    conv.check_completion_supported(req)
    tokenize_start = time.perf_counter()
    prompts = await _completion_prompts(state, req)
    tokenize_s = time.perf_counter() - tokenize_start if _has_text(req.prompt) else None
    echoes = [state.backend.decode(ids) if req.echo else "" for ids in prompts]
    jobs = []
    with conv.openai_names({**_COMPLETION_NAMES, **conv.grammar_param_names(req)}):
        for ids in prompts:
            max_new = conv.resolve_max_new_tokens(req.max_tokens, len(ids), state.backend.card.context_len,
                                                  16, "max_tokens", "prompt")
            jobs.append(PromptJob(ids, conv.sampling_params(req, max_new, req.logprobs), lora=lora))
        generation = state.dispatcher.open("completions", jobs, tokenize_s=tokenize_s)
    return CompletionRun(state, req, model, generation, echoes)


async def _respond(request: Request, run: CompletionRun | ChatRun, stream: bool) -> Response:
    headers = run.generation.timing_headers()
    if stream:
        return EventStreamResponse(with_error_events(run.events()), on_close=run.generation.aclose, headers=headers)
    try:
        response = _json(await unless_disconnected(request, run.collect()))
        response.headers.update(headers)
        return response
    finally:
        await run.generation.aclose()


def _has_text(prompt: Any) -> bool:
    """Whether a prompt is text (the request model keeps a list homogeneous: its first item tells)."""
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str))


async def _completion_prompts(state: GatewayState, req: CompletionRequest) -> list[list[int]]:
    """Each prompt's ids; the texts of a list tokenize together (the backend's pool encodes what waits at once)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [await state.backend.encode(prompt)]
    if not prompt:
        raise invalid_argument("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):  # one prompt of token ids (the request model keeps the list homogeneous)
        return [cast(list[int], prompt)]

    async def ids_of(p: str | list[int]) -> list[int]:
        return await state.backend.encode(p) if isinstance(p, str) else list(p)

    return list(await asyncio.gather(*(ids_of(p) for p in prompt if not isinstance(p, int))))


class CompletionRun:
    """One /v1/completions request turned into a response or a stream of chunks."""

    def __init__(self, state: GatewayState, req: CompletionRequest, model: str, generation: Generation,
                 echoes: list[str]) -> None:
        self.state, self.req, self.model, self.generation = state, req, model, generation
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.echoes = echoes
        self.states = [conv.ChoiceState() for _ in range(generation.num_seqs)]

    def _logprobs(self, chunk_ids: list[int], chunk: GenerationChunk, offset: int) \
            -> CompletionLogprobs | None:
        if self.req.logprobs is None:
            return None
        return conv.completion_logprobs(self.state.backend, chunk_ids, chunk.logprobs or [],
                                        chunk.top_logprobs or [], offset)

    async def collect(self) -> CompletionResponse:
        async for index, chunk in self.generation.stream():
            self.states[index].add(chunk)
        choices = []
        for index, st in enumerate(self.states):
            echo = self.echoes[index // self.req.n]
            logprobs = None
            if self.req.logprobs is not None:
                logprobs = conv.completion_logprobs(self.state.backend, st.token_ids, st.logprobs,
                                                    st.top_logprobs, len(echo))
            choices.append(CompletionChoice(index=index, text=echo + st.text, logprobs=logprobs,
                                            finish_reason=st.finish_reason))
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=conv.usage(self.states, self.req.n))

    def _chunk(self, choice: CompletionChoice) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice])

    async def chunks(self) -> AsyncGenerator[CompletionResponse, None]:
        """The stream's messages: text deltas per choice, then usage when asked for."""
        if self.req.echo:
            for index in range(len(self.states)):
                yield self._chunk(CompletionChoice(index=index, text=self.echoes[index // self.req.n]))
        async for index, chunk in self.generation.stream():
            st = self.states[index]
            offset = len(self.echoes[index // self.req.n]) + len(st.text)
            st.add(chunk)
            if chunk.text or chunk.token_ids or chunk.finished:
                yield self._chunk(CompletionChoice(index=index, text=chunk.text, finish_reason=chunk.finish_reason,
                                                   logprobs=self._logprobs(chunk.token_ids, chunk, offset)))
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            yield CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[],
                                     usage=conv.usage(self.states, self.req.n))

    async def events(self) -> AsyncGenerator[str, None]:
        async for chunk in self.chunks():
            yield event(chunk)
        yield DONE


# ---- chat ----------------------------------------------------------------------------------------
@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = get_state(request)
    run = await start_chat(state, parse_body(await request.body(), ChatCompletionRequest))
    return await _respond(request, run, run.req.stream)


async def start_chat(state: GatewayState, req: ChatCompletionRequest) -> ChatRun:
    """Validate and admit a chat request (HTTP and gRPC alike); the run is not started yet."""
    model, lora = state.resolve_model_adapter(req.model)
    model = req.model if lora is not None and req.model else model
    conv.check_chat_supported(req)
    setup = ChatSetup.of(state.config, state.backend.card, conv.chat_tools(req), req.include_reasoning,
                         req.separate_reasoning)
    with conv.openai_names(conv.grammar_param_names(req)):
        setup.check_no_grammar(bool(conv.grammar_fields(req)))
    mm = None
    tokenize_start = time.perf_counter()
    if has_images(req.messages):
        if setup.tools is not None:
            raise unsupported("tools with images are not supported yet", "tools")
        messages, sources = chat_with_images(req.messages)
        prompt = await state.backend.tokenize_multimodal(PromptWithImages(sources, messages=messages))
        input_ids, mm = prompt.input_ids, prompt.mm
    else:
        input_ids = await state.backend.apply_chat_template(*setup.template_inputs(conv.chat_messages(req.messages)))
    tokenize_s = time.perf_counter() - tokenize_start
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    names = {"max_new_tokens": max_param, "min_new_tokens": "min_tokens", "prompt": "messages",
             "structural_tag": "tools", **conv.grammar_param_names(req)}
    with conv.openai_names(names):
        max_new = conv.resolve_max_new_tokens(requested, len(input_ids), state.backend.card.context_len,
                                              state.config.max_default_tokens, max_param, "messages")
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = setup.sampling_params(conv.sampling_params(req, max_new, top))
        generation = state.dispatcher.open("chat_completions", [PromptJob(input_ids, params, mm, lora)],
                                           tokenize_s=tokenize_s)
    return ChatRun(state, req, model, generation, setup)


def _tool_call_deltas(calls: list[CallDelta]) -> list[ToolCallDelta] | None:
    if not calls:
        return None
    return [ToolCallDelta(index=c.index, id=c.id, type="function" if c.id else None,
                          function=FunctionCallDelta(name=c.name, arguments=c.arguments)) for c in calls]


class ChatRun:
    """One /v1/chat/completions request turned into a response or a stream of chunks."""

    def __init__(self, state: GatewayState, req: ChatCompletionRequest, model: str,
                 generation: Generation, setup: ChatSetup) -> None:
        self.state, self.req, self.model, self.generation = state, req, model, generation
        self.setup = setup
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.states = [conv.ChoiceState() for _ in range(generation.num_seqs)]
        self.outputs = [setup.new_output() for _ in range(generation.num_seqs)]
        """Each choice's reasoning, content and tool calls."""

    def _logprobs(self, token_ids: list[int], logprobs: list[float] | None,
                  top: list[list[tuple[int, float]]] | None) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        return ChatLogprobs(content=conv.chat_logprobs(self.state.backend, token_ids, logprobs or [], top or []))

    def message(self, index: int) -> AssistantMessage:
        """The whole answer of a finished choice."""
        out = self.outputs[index]
        calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                 for c in out.calls]
        content = out.content if out.content or not calls else None
        return AssistantMessage(content=content, reasoning_content=out.reasoning or None, tool_calls=calls or None)

    async def collect(self) -> ChatCompletionResponse:
        async for index, chunk in self.generation.stream():
            self.states[index].add(chunk)
        choices = []
        for i, st in enumerate(self.states):
            self.outputs[i].feed(st.text, final=True)
            choices.append(ChatChoice(index=i, message=self.message(i),
                                      finish_reason=self.outputs[i].finish_reason(st.finish_reason),
                                      logprobs=self._logprobs(st.token_ids, st.logprobs, st.top_logprobs)))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=conv.usage(self.states, self.req.n))

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    async def chunks(self) -> AsyncGenerator[ChatCompletionChunk, None]:
        """The stream's messages: the role, then content, reasoning and tool-call deltas and the finish reason
        per choice, then usage when asked for."""
        for index in range(len(self.states)):
            yield self._chunk(ChatChunkChoice(index=index, delta=Delta(role="assistant", content="")))
        async for index, chunk in self.generation.stream():
            self.states[index].add(chunk)
            out = self.outputs[index].feed(chunk.text, final=chunk.finished)
            if out or (self.req.logprobs and chunk.token_ids):
                delta = Delta(content=out.content if out.content or not (out.reasoning or out.calls) else None,
                              reasoning_content=out.reasoning or None, tool_calls=_tool_call_deltas(out.calls))
                logprobs = self._logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs)
                yield self._chunk(ChatChunkChoice(index=index, delta=delta, logprobs=logprobs))
            if chunk.finished:
                reason = self.outputs[index].finish_reason(chunk.finish_reason)
                yield self._chunk(ChatChunkChoice(index=index, delta=Delta(), finish_reason=reason))
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            yield ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                      usage=conv.usage(self.states, self.req.n))

    async def events(self) -> AsyncGenerator[str, None]:
        async for chunk in self.chunks():
            yield event(chunk)
        yield DONE
