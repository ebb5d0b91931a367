"""Admission, fan-out and bookkeeping of generation requests, shared by the OpenAI and native APIs.

One HTTP request is one `Generation`: one or more prompts, each with n branches. Its
sequences are numbered prompt-major (`index = prompt * n + branch`, OpenAI's choice
index) and streamed from the backend merged, as `(index, chunk)` pairs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from radixmesh.common import tracing
from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.gateway import request_trace
from radixmesh.gateway.backend import GatewayBackend, GenerationChunk, SamplingParams
from radixmesh.gateway.metrics import GatewayMetrics
from radixmesh.wire.images import MultimodalInputs


@dataclass(frozen=True)
class PromptJob:
    """One prompt of a request, with its (possibly n > 1) sampling parameters."""

    input_ids: list[int]
    params: SamplingParams
    mm: MultimodalInputs | None = None
    """The prompt's images (from `GatewayBackend.tokenize_multimodal`); None for text."""
    lora: str | None = None
    """The LoRA adapter the prompt runs with (None: the base model)."""

    @property
    def mm_kwargs(self) -> dict[str, Any]:
        """`mm=...` and `lora=...` for the backend calls of a prompt with images or an adapter; nothing else."""
        kwargs: dict[str, Any] = {"mm": self.mm} if self.mm is not None else {}
        if self.lora is not None:
            kwargs["lora"] = self.lora
        return kwargs


class Dispatcher:
    """Admits requests against the queue limit and knows which sequences each request runs."""

    def __init__(self, backend: GatewayBackend, metrics: GatewayMetrics, max_queued_requests: int | None) -> None:
        self.backend = backend
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.num_in_flight = 0
        """Sequences admitted and not finished."""
        self.active: dict[str, Generation] = {}

    @property
    def capacity(self) -> int | None:
        """Most sequences in flight: the engine's running slots plus the allowed queue."""
        if self.max_queued_requests is None:
            return None
        return self.backend.card.max_running_requests + self.max_queued_requests

    def open(self, endpoint: str, jobs: list[PromptJob], request_id: str | None = None,
             rids: list[str] | None = None, tokenize_s: float | None = None) -> Generation:
        """Admit a request (429 when the queue is full) and return its not yet started generation.

        `rids` names the engine sequences (one per prompt and branch); by default they derive
        from `request_id`, which `abort` accepts as well. `tokenize_s`: the time the request's text
        took to become token ids (None: it came as ids), reported in its response's Server-Timing.
        """
        reason = self.backend.not_ready_reason()
        if reason:
            raise RadixMeshError(ErrorCode.UNAVAILABLE, reason)
        for job in jobs:
            self.backend.validate(job.input_ids, job.params, **job.mm_kwargs)
        num_seqs = sum(job.params.n for job in jobs)
        capacity = self.capacity
        if capacity is not None and self.num_in_flight + num_seqs > capacity:
            self.metrics.rejected.inc()
            raise RadixMeshError(ErrorCode.RESOURCE_EXHAUSTED,
                                 f"the server is overloaded: {self.num_in_flight} sequences in flight, "
                                 f"at most {capacity} (--max-queued-requests {self.max_queued_requests}); "
                                 "retry later")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.active:
            raise RadixMeshError(ErrorCode.INVALID_ARGUMENT, f"request id {request_id!r} is already running", "rid")
        if rids is not None and len(rids) != num_seqs:
            raise RadixMeshError(ErrorCode.INVALID_ARGUMENT, f"got {len(rids)} request ids for {num_seqs} sequences",
                                 "rid")
        generation = Generation(self, request_id, jobs, rids)
        if tokenize_s is not None:  # the request arrived before its text was tokenized: TTFT counts from then
            generation.tokenize_s = tokenize_s
            generation.start_s -= tokenize_s
            self.metrics.tokenize.observe(tokenize_s)
        self.num_in_flight += num_seqs
        self.active[request_id] = generation
        num_prompt_tokens = sum(len(job.input_ids) for job in jobs)
        request_trace.mark("t_open", rid=generation.rids[0], prompt_tokens=num_prompt_tokens, tokenize_s=tokenize_s)
        self.metrics.observe_admitted(endpoint, num_prompt_tokens)
        if tracing.enabled():  # on the HTTP span: which request this trace is
            tracing.set_attributes({"radixmesh.request_id": request_id, "radixmesh.endpoint": endpoint,
                                    "radixmesh.num_sequences": num_seqs, "radixmesh.prompt_tokens": num_prompt_tokens})
        return generation

    def _release(self, generation: Generation) -> None:
        if self.active.get(generation.request_id) is generation:
            del self.active[generation.request_id]
            self.num_in_flight -= generation.num_seqs

    async def abort(self, request_id: str) -> None:
        """Abort a request by the id the gateway reported (or one engine sequence id)."""
        generation = self.active.get(request_id)
        rids = generation.rids if generation is not None else [request_id]
        await asyncio.gather(*(self.backend.abort(rid) for rid in rids))

    async def abort_all(self) -> None:
        await asyncio.gather(*(self.abort(request_id) for request_id in list(self.active)))


class Generation:
    """The sequences of one admitted request; iterate once, and always `aclose()` (idempotent)."""

    def __init__(self, dispatcher: Dispatcher, request_id: str, jobs: list[PromptJob],
                 rids: list[str] | None = None) -> None:
        self.dispatcher = dispatcher
        self.request_id = request_id
        self.jobs = jobs
        self.start_s = time.perf_counter()
        self.seqs: list[tuple[list[int], SamplingParams]] = []
        self.seq_jobs: list[PromptJob] = []
        """The prompt of each sequence."""
        backend = dispatcher.backend
        for job in jobs:
            branches = backend.branch_params(job.params)
            self.seqs += [(job.input_ids, branch) for branch in branches]
            self.seq_jobs += [job] * len(branches)
        self.num_seqs = len(self.seqs)
        if rids is None:
            rids = [request_id] if self.num_seqs == 1 else [f"{request_id}-{i}" for i in range(self.num_seqs)]
        self.rids = rids
        self.tokenize_s: float | None = None
        """Time the request's text took to become token ids (None: it came as ids)."""
        self._last_token_s: list[float | None] = [None] * self.num_seqs
        self._stream: AsyncGenerator[tuple[int, GenerationChunk], None] | None = None

    def timing_headers(self) -> dict[str, str]:
        """`Server-Timing` of the work done before the engine saw the request (W3C Server Timing)."""
        if self.tokenize_s is None:
            return {}
        return {"Server-Timing": f"tokenize;dur={self.tokenize_s * 1e3:.3f}"}

    def stream(self) -> AsyncIterator[tuple[int, GenerationChunk]]:
        """The merged `(index, chunk)` stream of all sequences; can be taken once."""
        assert self._stream is None, "a generation streams once"
        self._stream = self._merged()
        return self._stream

    async def _merged(self) -> AsyncGenerator[tuple[int, GenerationChunk], None]:
        if self.num_seqs == 1:
            async with contextlib.aclosing(self._sequence(0)) as chunks:
                async for chunk in chunks:
                    yield 0, chunk
            return
        await self._cache_shared_prompts()
        queue: asyncio.Queue[tuple[int, GenerationChunk] | Exception] = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(i, queue)) for i in range(self.num_seqs)]
        try:
            remaining = self.num_seqs
            while remaining:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item[1].finished:
                    remaining -= 1
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _cache_shared_prompts(self) -> None:
        shared = {(tuple(job.input_ids), job.lora): job for job in self.jobs if job.params.n > 1}
        backend = self.dispatcher.backend
        await asyncio.gather(*(backend.cache_prefix(list(ids), **job.mm_kwargs) for (ids, _), job in shared.items()))

    async def _pump(self, index: int, queue: asyncio.Queue[tuple[int, GenerationChunk] | Exception]) -> None:
        try:
            async with contextlib.aclosing(self._sequence(index)) as chunks:
                async for chunk in chunks:
                    queue.put_nowait((index, chunk))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait(exc)

    async def _sequence(self, index: int) -> AsyncGenerator[GenerationChunk, None]:
        input_ids, params = self.seqs[index]
        unfinished = "abort"  # left early: the client went away or the server is stopping
        try:
            stream = self.dispatcher.backend.generate(input_ids, params, self.rids[index],
                                                      **self.seq_jobs[index].mm_kwargs)
            async with contextlib.aclosing(stream) as chunks:
                async for chunk in chunks:
                    if chunk.finished:
                        unfinished = ""
                    yield self._observe(index, chunk)
        except RadixMeshError:
            unfinished = "error"
            raise
        finally:
            if unfinished:
                self.dispatcher.metrics.observe_finished(unfinished, time.perf_counter() - self.start_s)

    def _observe(self, index: int, chunk: GenerationChunk) -> GenerationChunk:
        metrics = self.dispatcher.metrics
        now = time.perf_counter()
        last = self._last_token_s[index]
        if chunk.token_ids:
            if last is None:  # a branch of n > 1 waited for the shared prompt first: no engine share to subtract
                request_trace.mark("t_first_chunk", now)
                engine_s = chunk.engine_ttft_s if self.num_seqs == 1 else None
                metrics.observe_first_token(now - self.start_s, chunk.cached_tokens, engine_s)
            metrics.observe_tokens(len(chunk.token_ids), None if last is None else now - last)
            self._last_token_s[index] = now
        if chunk.finished:
            metrics.observe_finished(chunk.finish_reason or "", now - self.start_s)
        lora = self.seq_jobs[index].lora
        if lora is not None and (chunk.token_ids or chunk.finished):
            metrics.observe_adapter(lora, len(chunk.token_ids), chunk.finished)
        return chunk

    async def aclose(self) -> None:
        """Stop unfinished sequences (the backend aborts them and frees their KV) and release the admission."""
        try:
            if self._stream is not None:
                await self._stream.aclose()
        finally:
            self.dispatcher._release(self)
