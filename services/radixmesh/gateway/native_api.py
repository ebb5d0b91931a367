"""SGLang-compatible native routes, so a worker can sit behind routers built for SGLang.

/generate streams cumulative text and output_ids per event (SGLang's default, non-incremental
mode), ending in `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from radixmesh import __version__
from radixmesh.common import aio
from radixmesh.common.errors import ErrorCode, RadixMeshError, invalid_argument, not_found
from radixmesh.engine.mm.prompt import PromptWithImages
from radixmesh.gateway import openai_convert as conv
from radixmesh.gateway.backend import SamplingParams
from radixmesh.gateway.dispatch import Generation, PromptJob
from radixmesh.gateway.images import native_image_sources
from radixmesh.gateway.metrics import CONTENT_TYPE_LATEST
from radixmesh.gateway.protocol import RequestBody, parse_body
from radixmesh.gateway.sse import DONE, EventStreamResponse, with_error_events
from radixmesh.gateway.state import GatewayState, get_state, unless_disconnected
from radixmesh.wire.images import MultimodalInputs

router = APIRouter(tags=["native"])
HEALTH_GENERATE_TIMEOUT_S = 20.0


class NativeSamplingParams(RequestBody):
    """SGLang's sampling_params; max_new_tokens None means up to the context end (capped)."""

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    seed: int | None = None
    sampling_seed: int | None = None
    logit_bias: dict[str, float] | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    """An xgrammar structural tag, as JSON text or an object."""


class GenerateRequest(RequestBody):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int | list[int] = -1
    """With return_logprob: also score prompt tokens from this position on (per prompt when a list); -1: none."""
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    image_data: Any = None
    lora_path: Any = None


class AbortRequest(RequestBody):
    rid: str = ""
    abort_all: bool = False


# ---- /generate -----------------------------------------------------------------------------------
@router.post("/generate")
async def generate(request: Request) -> Response:
    state = get_state(request)
    req = parse_body(await request.body(), GenerateRequest)
    tokenize_start = time.perf_counter()
    prompts, mms, batched = await _prompts(state, req)
    tokenize_s = time.perf_counter() - tokenize_start if req.text is not None else None
    per_prompt = req.sampling_params if isinstance(req.sampling_params, list) \
        else [req.sampling_params or NativeSamplingParams()] * len(prompts)
    if len(per_prompt) != len(prompts):
        raise invalid_argument(f"got {len(per_prompt)} sampling_params for {len(prompts)} prompts", "sampling_params")
    asks = _logprob_asks(req, len(prompts))
    rid = req.rid if isinstance(req.rid, str) else None
    rids = req.rid if isinstance(req.rid, list) else None
    prompt_param = "input_ids" if req.input_ids is not None else "text"
    with conv.openai_names({"prompt": prompt_param, "top_logprobs": "top_logprobs_num"}):  # SGLang's names
        jobs = [PromptJob(ids, _params(state, req, sp, len(ids), ask), mm, lora)
                for ids, sp, ask, mm, lora in zip(prompts, per_prompt, asks, mms, _loras(state, req, len(prompts)))]
        generation = state.dispatcher.open("generate", jobs, request_id=rid, rids=rids, tokenize_s=tokenize_s)
    run = _NativeRun(state, req, generation, batched or len(generation.rids) > 1)
    if req.stream:
        return EventStreamResponse(with_error_events(run.events()), on_close=generation.aclose,
                                   headers=generation.timing_headers())
    try:
        return JSONResponse(await unless_disconnected(request, run.collect()), headers=generation.timing_headers())
    finally:
        await generation.aclose()


async def _prompts(state: GatewayState, req: GenerateRequest) \
        -> tuple[list[list[int]], list[MultimodalInputs | None], bool]:
    """Each prompt's token ids and images (placeholders expanded), and whether the request is a batch.
    The prompts of a batch tokenize together (the backend's pool encodes what waits at once)."""
    raw, batched = _raw_prompts(req)

    async def one(prompt: str | list[int], sources: list[Any]) -> tuple[list[int], MultimodalInputs | None]:
        if sources:
            kind = {"text": prompt} if isinstance(prompt, str) else {"input_ids": prompt}
            placed = await state.backend.tokenize_multimodal(PromptWithImages(sources, **kind))
            return placed.input_ids, placed.mm
        return (await state.backend.encode(prompt) if isinstance(prompt, str) else prompt), None

    sources = native_image_sources(req.image_data, len(raw), batched)
    if len(raw) == 1:
        placed = [await one(raw[0], sources[0])]
    else:
        placed = await asyncio.gather(*(one(p, s) for p, s in zip(raw, sources)))
    return [ids for ids, _ in placed], [mm for _, mm in placed], batched


def _loras(state: GatewayState, req: GenerateRequest, num_prompts: int) -> list[str | None]:
    """Each prompt's LoRA adapter: SGLang's `lora_path`, an adapter name or one per prompt (None: the base)."""
    value = req.lora_path
    names = value if isinstance(value, list) else [value] * num_prompts
    if len(names) != num_prompts or not all(n is None or isinstance(n, str) for n in names):
        raise invalid_argument(f"lora_path must be an adapter name or a list of {num_prompts} (names or null)",
                               "lora_path")
    if any(names) and not state.backend.card.serves_lora:
        missing = next(n for n in names if n)
        raise not_found(f"LoRA adapter {missing!r} is not loaded: this server serves no adapters", "lora_path")
    return [n or None for n in names]


def _raw_prompts(req: GenerateRequest) -> tuple[list[str | list[int]], bool]:
    if (req.text is None) == (req.input_ids is None):
        raise invalid_argument("give exactly one of text and input_ids", "text")
    if req.text is not None:
        texts: list[str | list[int]] = [req.text] if isinstance(req.text, str) else list(req.text)
        return texts, isinstance(req.text, list)
    ids = req.input_ids or []
    if ids and isinstance(ids[0], list):
        return [list(p) for p in ids], True
    return [list(ids)], False


def _per_prompt(value: int | list[int], num_prompts: int, param: str) -> list[int]:
    if isinstance(value, int):
        return [value] * num_prompts
    if len(value) != num_prompts:
        raise invalid_argument(f"got {len(value)} values of {param} for {num_prompts} prompts", param)
    return value


def _logprob_asks(req: GenerateRequest, num_prompts: int) -> list[tuple[int, int]]:
    """(logprob_start_len, top_logprobs) of each prompt; (-1, 0) without return_logprob."""
    if not req.return_logprob:
        return [(-1, 0)] * num_prompts
    starts = _per_prompt(req.logprob_start_len, num_prompts, "logprob_start_len")
    return list(zip(starts, _per_prompt(req.top_logprobs_num, num_prompts, "top_logprobs_num")))


def _params(state: GatewayState, req: GenerateRequest, sp: NativeSamplingParams, prompt_len: int,
            logprob_ask: tuple[int, int]) -> SamplingParams:
    fields = sp.model_dump(exclude={"structural_tag", "json_schema", "sampling_seed", "stop", "stop_token_ids",
                                    "logit_bias"})
    fields["json_schema"] = sp.json_schema if not isinstance(sp.json_schema, dict) else json.dumps(sp.json_schema)
    fields["structural_tag"] = sp.structural_tag if not isinstance(sp.structural_tag, dict) \
        else json.dumps(sp.structural_tag)
    fields["max_new_tokens"] = conv.resolve_max_new_tokens(
        sp.max_new_tokens, prompt_len, state.backend.card.context_len, state.config.max_default_tokens,
        "max_new_tokens", "input_ids" if req.input_ids is not None else "text")
    fields["seed"] = sp.seed if sp.seed is not None else sp.sampling_seed
    fields["stop"] = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
    fields["stop_token_ids"] = tuple(sp.stop_token_ids or ())
    fields["logit_bias"] = conv.logit_bias(sp.logit_bias or {})
    fields["logprobs"] = req.return_logprob
    fields["logprob_start_len"], fields["top_logprobs"] = logprob_ask
    return SamplingParams(**fields)


class _GrowingJson:
    """The cumulative `text` and `output_ids` of one sequence's stream events, JSON-encoded as they grow.

    SGLang's stream events repeat everything generated so far; encoding that whole each time made a
    stream cost O(tokens^2) on the front end's event loop (at 2k tokens, most of its busy time). Both
    only ever grow, and JSON escapes character by character, so the new part is encoded and appended.
    """

    def __init__(self) -> None:
        self.text_json, self.ids_json = "", ""
        self.num_chars = self.num_ids = 0

    def update(self, st: conv.ChoiceState) -> tuple[str, str]:
        """`text` as a JSON string and `output_ids` as a JSON array, for `st` as it is now."""
        if len(st.text) > self.num_chars:
            self.text_json += json.dumps(st.text[self.num_chars:])[1:-1]
            self.num_chars = len(st.text)
        if len(st.token_ids) > self.num_ids:
            new = ", ".join(map(str, st.token_ids[self.num_ids:]))
            self.ids_json = f"{self.ids_json}, {new}" if self.ids_json else new
            self.num_ids = len(st.token_ids)
        return f'"{self.text_json}"', f"[{self.ids_json}]"


class _NativeRun:
    """One /generate request: SGLang result dicts (text, output_ids, meta_info)."""

    def __init__(self, state: GatewayState, req: GenerateRequest, generation: Generation, as_list: bool) -> None:
        self.state, self.req, self.generation, self.as_list = state, req, generation, as_list
        self.states = [conv.ChoiceState() for _ in range(generation.num_seqs)]
        self.encoded = [_GrowingJson() for _ in self.states]

    def _result(self, index: int) -> dict[str, Any]:
        st = self.states[index]
        return {"text": st.text, "output_ids": list(st.token_ids), "meta_info": self._meta(index)}

    def _event(self, index: int) -> str:
        """One stream event, as `json.dumps` of `_result` (plus `index` for a batch) would write it."""
        if self.req.return_logprob:  # log-prob lists grow too, but are asked for rarely: encoded whole
            result = self._result(index)
            if self.as_list:
                result["index"] = index
            return f"data: {json.dumps(result)}\n\n"
        text, ids = self.encoded[index].update(self.states[index])
        tail = f', "index": {index}' if self.as_list else ""
        return f'data: {{"text": {text}, "output_ids": {ids}, "meta_info": {json.dumps(self._meta(index))}{tail}}}\n\n'

    def _meta(self, index: int) -> dict[str, Any]:
        st = self.states[index]
        meta: dict[str, Any] = {
            "id": self.generation.rids[index], "prompt_tokens": st.prompt_tokens,
            "completion_tokens": st.completion_tokens, "cached_tokens": st.cached_tokens,
            "finish_reason": _finish_reason(st), "e2e_latency": time.perf_counter() - self.generation.start_s,
        }
        if self.req.return_logprob:
            meta.update(self._logprobs(st, self.generation.seqs[index][0]))
        return meta

    def _logprobs(self, st: conv.ChoiceState, input_ids: list[int]) -> dict[str, Any]:
        """SGLang's [logprob, token_id, text-or-None] triples; prompt ones from logprob_start_len on."""
        scored_ids = input_ids[len(input_ids) - len(st.input_logprobs):] if st.input_logprobs else []
        texts: dict[int, str | None] = {}
        if self.req.return_text_in_logprobs:
            ids = set(st.token_ids) | set(scored_ids)
            ids |= {t for row in st.top_logprobs + st.input_top_logprobs for t, _ in row or ()}
            texts = dict(zip(sorted(ids), self.state.backend.token_texts(sorted(ids))))

        def triples(row: list[tuple[int, float]] | None) -> list[list[Any]] | None:
            return None if row is None else [[lp, t, texts.get(t)] for t, lp in row]

        return {
            "input_token_logprobs": [[lp, t, texts.get(t)] for lp, t in zip(st.input_logprobs, scored_ids)],
            "output_token_logprobs": [[lp, t, texts.get(t)] for lp, t in zip(st.logprobs, st.token_ids)],
            "input_top_logprobs": [triples(row) for row in st.input_top_logprobs],
            "output_top_logprobs": [triples(row) for row in st.top_logprobs],
        }

    async def collect(self) -> Any:
        async for index, chunk in self.generation.stream():
            self.states[index].add(chunk)
        results = [self._result(i) for i in range(len(self.states))]
        return results if self.as_list else results[0]

    async def events(self) -> AsyncGenerator[str, None]:
        async for index, chunk in self.generation.stream():
            self.states[index].add(chunk)
            if chunk.text or chunk.token_ids or chunk.finished:
                yield self._event(index)
        yield DONE


def _finish_reason(st: conv.ChoiceState) -> dict[str, Any] | None:
    if st.finish_reason is None:
        return None
    if st.finish_reason == "length":
        return {"type": "length", "length": st.completion_tokens}
    if st.finish_reason == "abort":
        return {"type": "abort", "message": "the request was aborted"}
    return {"type": st.finish_reason, "matched": st.matched_stop}


# ---- health, info and control --------------------------------------------------------------------
def _unavailable(state: GatewayState) -> None:
    if not state.backend.is_healthy:
        raise RadixMeshError(ErrorCode.UNAVAILABLE, "the engine is not running")


@router.get("/health")
async def health(request: Request) -> Response:
    _unavailable(get_state(request))
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Generate one token end to end: proves the scheduler process is stepping, not only alive."""
    backend = get_state(request).backend
    _unavailable(get_state(request))
    input_ids = await backend.encode("Hi") if backend.has_tokenizer else [0]
    params = SamplingParams(max_new_tokens=1, temperature=0.0)

    async def one_token() -> None:
        async with contextlib.aclosing(backend.generate(input_ids or [0], params)) as chunks:
            async for _ in chunks:
                pass

    try:
        await aio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise RadixMeshError(ErrorCode.UNAVAILABLE, "the engine did not generate a token in time") from None
    return Response(status_code=200)


def _model_info(state: GatewayState) -> dict[str, Any]:
    card = state.backend.card
    return {"model_path": card.model_path, "tokenizer_path": card.tokenizer_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default",
            "has_image_understanding": card.has_image_understanding,
            "has_audio_understanding": False, "served_model_name": card.name, "context_len": card.context_len,
            "vocab_size": card.vocab_size}


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> Response:
    return JSONResponse(_model_info(get_state(request)))


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> Response:
    state = get_state(request)
    _unavailable(state)
    stats = await state.backend.server_info()
    info = {**state.backend.card.extra, **_model_info(state), "version": __version__,
            "host": state.config.host, "port": state.config.port,
            "api_key_set": state.config.api_key is not None or state.config.api_key_file is not None,
            "grpc_port": state.config.grpc_port, "tls": state.config.serves_tls,
            "max_queued_requests": state.config.max_queued_requests,
            "num_gateway_requests": state.dispatcher.num_in_flight, **stats, "internal_states": [stats]}
    # A router's aggregated load does not know the workers' running slots; the model card does.
    info["max_running_requests"] = stats.get("max_running_requests") or state.backend.card.max_running_requests
    return JSONResponse(info)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    state = get_state(request)
    _unavailable(state)
    if not await state.backend.flush_cache():
        raise invalid_argument("cannot flush the cache while requests are running or waiting; retry when idle")
    return PlainTextResponse("Cache flushed.\n")


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    state = get_state(request)
    body = await request.body()
    req = parse_body(body, AbortRequest) if body else AbortRequest()
    if req.abort_all:
        await state.dispatcher.abort_all()
    elif req.rid:
        await state.dispatcher.abort(req.rid)
    else:
        raise invalid_argument("give rid or abort_all", "rid")
    return JSONResponse({})


@router.get("/version")
async def version() -> Response:
    return JSONResponse({"version": __version__})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = get_state(request)
    if state.backend.is_healthy:
        with contextlib.suppress(RadixMeshError, asyncio.TimeoutError):
            stats = await aio.wait_for(state.backend.server_info(), 5.0)
            state.metrics.update_engine(stats, state.dispatcher.num_in_flight)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
