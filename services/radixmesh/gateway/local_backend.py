"""`local` backend: the tokenizer in this process, the scheduler in its own process (no gRPC, no router).

Prompts are tokenized on a `TokenizerPool` (worker threads), never on the event loop that streams
every request's tokens. `radixmesh serve` traces here what the cluster's services trace:
`serve.tokenize`, then from the scheduler's timestamps `serve.queue`, `serve.prefill`, `serve.decode`,
and `serve.detokenize`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from radixmesh.common import tracing
from radixmesh.common.errors import invalid_argument
from radixmesh.engine.chat_template import takes_tools, template_text, tool_syntax
from radixmesh.engine.client import EngineClient
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.hf_tokenizer import decode_text, render_chat, token_texts
from radixmesh.engine.loader.default_model import DEFAULT_MODEL_ALIASES, DEFAULT_MODEL_NAME
from radixmesh.engine.mm.config import ImageLimits
from radixmesh.engine.mm.prompt import MultimodalProcessor, MultimodalPrompt, PromptWithImages, text_only_error
from radixmesh.engine.output import TextAssembler
from radixmesh.engine.tokenize_pool import DEFAULT_TOKENIZER_WORKERS, TokenizerPool, traced
from radixmesh.gateway import request_trace
from radixmesh.gateway.backend import GatewayBackend, GenerationChunk, ModelCard, SamplingParams
from radixmesh.wire.images import MultimodalInputs
from radixmesh.worker.timeline import RequestTimeline


class LocalEngineBackend(GatewayBackend):
    """Owns one `EngineClient` (and through it the scheduler process)."""

    def __init__(self, client: EngineClient, served_model_name: str | None = None,
                 image_limits: ImageLimits | None = None, tokenizer_workers: int = DEFAULT_TOKENIZER_WORKERS) -> None:
        self.client = client
        self.tokenize_pool = TokenizerPool(client.tokenizer, tokenizer_workers) if client.tokenizer is not None \
            else None
        """Encodes prompts on worker threads (None: a model without a tokenizer takes token ids only)."""
        prepared = client.prepared
        self.images = MultimodalProcessor.for_model(prepared.config, [prepared.model_path, prepared.tokenizer_path],
                                                    client.tokenizer, image_limits)
        """Reads and places the images of prompts, in this process (None: a text-only model)."""
        self._card = _make_card(client, served_model_name, self.images is not None)
        self._closed = False
        self._queue_time: Any = None

    @classmethod
    async def start(cls, config: EngineConfig, served_model_name: str | None = None,
                    image_limits: ImageLimits | None = None,
                    tokenizer_workers: int = DEFAULT_TOKENIZER_WORKERS) -> LocalEngineBackend:
        """Prepare the model (first use downloads and converts the default one) and start the scheduler."""
        return cls(await EngineClient.start(config), served_model_name, image_limits, tokenizer_workers)

    @property
    def card(self) -> ModelCard:
        return self._card

    @property
    def is_healthy(self) -> bool:
        return not self._closed and self.client.is_alive

    @property
    def has_tokenizer(self) -> bool:
        return self.client.tokenizer is not None

    # ---- text <-> tokens ------------------------------------------------------------------------
    def _tokenizer(self, param: str) -> Any:
        if self.client.tokenizer is None:
            raise invalid_argument("this model has no tokenizer; send token ids", param)
        return self.client.tokenizer

    def _pool(self, param: str) -> TokenizerPool:
        self._tokenizer(param)
        assert self.tokenize_pool is not None, "a tokenizer without a pool"
        return self.tokenize_pool

    async def encode(self, text: str) -> list[int]:
        return (await traced("serve.tokenize", "text", self._pool("prompt").encode(text))).ids

    async def apply_chat_template(self, messages: list[dict[str, Any]],
                                  tools: list[dict[str, Any]] | None = None) -> list[int]:
        return (await traced("serve.tokenize", "chat",
                              self._pool("messages").encode_chat(messages, tools=tools))).ids

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return render_chat(self._tokenizer("messages"), messages, add_generation_prompt)

    async def tokenize_multimodal(self, prompt: PromptWithImages) -> MultimodalPrompt:
        if self.images is None:
            raise text_only_error(self._card.name, prompt.images)
        images = self.images
        # decoding and resizing images takes milliseconds to seconds: off the event loop
        if not tracing.enabled():
            return await asyncio.to_thread(images.prepare, prompt)
        with tracing.span("serve.tokenize", {"tokenize.input": "images", "tokenize.images": len(prompt.images)}):
            return await asyncio.to_thread(images.prepare, prompt)

    def decode(self, token_ids: list[int]) -> str:
        return decode_text(self._tokenizer("prompt"), token_ids)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        if self.client.tokenizer is None:
            return [f"<{tid}>" for tid in token_ids]
        return token_texts(self.client.tokenizer, token_ids)

    # ---- generation -----------------------------------------------------------------------------
    def validate(self, input_ids: list[int], params: SamplingParams, mm: MultimodalInputs | None = None,
                 lora: str | None = None) -> None:
        self.client.validate(input_ids, params, mm=mm, lora=lora)

    def bind_queue_time(self, histogram: Any) -> None:
        self._queue_time = histogram

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
                       mm: MultimodalInputs | None = None,
                       lora: str | None = None) -> AsyncGenerator[GenerationChunk, None]:
        """EngineClient.generate, plus the timeline of the request (queue-time metric, phase spans)."""
        rid = rid or uuid.uuid4().hex
        tokenizer = self.client.tokenizer
        assembler = TextAssembler(tokenizer, params) if tokenizer is not None else None
        timeline = RequestTimeline(rid, len(input_ids), {"radixmesh.role": "unified"}, queue_time=self._queue_time,
                                   itl=None, span_prefix="serve")  # the gateway's metrics observe the gaps
        detokenize_ns = 0
        engine_start: float | None = time.perf_counter()
        request_trace.mark("t_submit", engine_start)
        try:
            async for out in self.client.generate_tokens(input_ids, params, rid, mm=mm, lora=lora):
                timeline.on_output(out)
                start_ns = time.perf_counter_ns()
                chunk = assembler.feed(out) if assembler is not None else GenerationChunk.of(out)
                detokenize_ns += time.perf_counter_ns() - start_ns
                if engine_start is not None:
                    chunk.engine_ttft_s, engine_start = start_ns / 1e9 - engine_start, None
                    request_trace.mark("t_first_out", start_ns / 1e9)
                yield chunk
        finally:
            timeline.close()
            if tracing.enabled() and timeline.first_token_ns is not None:
                tracing.record_span("serve.detokenize", timeline.first_token_ns, timeline.last_token_ns or 0, {
                    "radixmesh.request_id": rid, "detokenize.output_tokens": timeline.num_output_tokens,
                    "detokenize.busy_ms": round(detokenize_ns / 1e6, 3)}, timeline.parent)

    async def cache_prefix(self, input_ids: list[int], mm: MultimodalInputs | None = None,
                           lora: str | None = None) -> None:
        await self.client.cache_prefix(input_ids, mm, lora)

    def branch_params(self, params: SamplingParams) -> list[SamplingParams]:
        return self.client.branch_params(params)

    async def abort(self, rid: str) -> None:
        await self.client.abort(rid)

    # ---- control ---------------------------------------------------------------------------------
    async def flush_cache(self) -> bool:
        return await self.client.flush_cache()

    async def server_info(self) -> dict[str, Any]:
        return await self.client.get_server_info()

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.tokenize_pool is not None:
                self.tokenize_pool.close()
            await self.client.shutdown()

    async def list_lora_adapters(self) -> list[dict[str, Any]]:
        return await self.client.list_lora_adapters()

    async def load_lora_adapter(self, name: str, path: str, worker_id: str = "") -> dict[str, Any]:
        _one_server(worker_id)
        return await self.client.load_lora_adapter(name, path)

    async def unload_lora_adapter(self, name: str, worker_id: str = "") -> dict[str, Any]:
        _one_server(worker_id)
        await self.client.unload_lora_adapter(name)
        return {}


def _make_card(client: EngineClient, served_model_name: str | None, has_images: bool) -> ModelCard:
    prepared = client.prepared
    aliases = {prepared.name}
    if client.config.model:
        aliases.add(client.config.model)
    if prepared.model_path is not None:
        aliases |= {str(prepared.model_path), Path(prepared.model_path).name}
    if prepared.name == DEFAULT_MODEL_NAME:
        aliases |= DEFAULT_MODEL_ALIASES
    name = served_model_name or prepared.name
    running = int(client.server_info.get("max_running_requests", client.config.max_running_requests))
    template = template_text(client.tokenizer)
    return ModelCard(
        name=name, aliases=frozenset(aliases - {name}),
        model_path=str(prepared.model_path or ""), tokenizer_path=str(prepared.tokenizer_path or ""),
        context_len=client.context_len, vocab_size=client.model_config.vocab_size,
        max_running_requests=running, created=int(time.time()),
        extra={"backend": "local", **dataclasses.asdict(client.config)}, has_image_understanding=has_images,
        chat_template_takes_tools=takes_tools(template), chat_template_tool_syntax=tool_syntax(template),
        serves_lora=client.config.lora_enabled,
    )


def _one_server(worker_id: str) -> None:
    if worker_id:
        raise invalid_argument(f"worker_id {worker_id!r}: this server is one engine (worker_id names a worker of a "
                               "cluster gateway)", "worker_id")
