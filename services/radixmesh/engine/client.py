"""Async front end of one scheduler process: start it, stream requests through it, stop it.

Every front end (the Python `Engine`, the HTTP gateway, the gRPC worker) talks to
the scheduler through this class only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import tempfile
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, TypeAlias

import msgspec
import zmq
import zmq.asyncio

from radixmesh.common import aio
from radixmesh.common.errors import ErrorCode, RadixMeshError, invalid_argument, not_found
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.distributed.layout import check_tensor_parallel
from radixmesh.engine.hf_tokenizer import load_tokenizer
from radixmesh.engine.loader import PreparedModel, prepare_model
from radixmesh.engine.malloc_env import spawn_env
from radixmesh.engine.mm.validate import validate_images
from radixmesh.engine.output import TextAssembler
from radixmesh.engine.sampling.validation import validate_request, validate_resume
from radixmesh.engine.scheduler.process import run_scheduler_process
from radixmesh.wire.disagg import (
    CommitFetchMsg,
    ExportCachedReqMsg,
    KVExportMsg,
    PrefillReqMsg,
    PrefixLenReqMsg,
    ReserveReqMsg,
    ResolveReservationMsg,
    TransferDoneReqMsg,
)
from radixmesh.wire.images import MultimodalInputs, masked_text_ids
from radixmesh.wire.kv_events import KVEventsMsg
from radixmesh.wire.messages import (
    AbortReqMsg,
    BatchOutMsg,
    FatalMsg,
    FlushCacheReqMsg,
    GenerateReqMsg,
    LoraListReqMsg,
    LoraLoadReqMsg,
    LoraUnloadReqMsg,
    QueryOutMsg,
    ReadyMsg,
    ServerInfoReqMsg,
    ShutdownReqMsg,
    TokenOut,
    encoder,
    from_scheduler_decoder,
)
from radixmesh.wire.outputs import GenerationChunk
from radixmesh.wire.sampling import SamplingParams

logger = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 900.0
QUERY_TIMEOUT_S = 60.0
StreamedMsg: TypeAlias = GenerateReqMsg | PrefillReqMsg | ResolveReservationMsg | ExportCachedReqMsg | CommitFetchMsg
"""Requests answered by a stream of TokenOut (a prefill's or an export's also by its KVExportMsg chunks, before its
last)."""
QueryMsg: TypeAlias = (FlushCacheReqMsg | ServerInfoReqMsg | ReserveReqMsg | TransferDoneReqMsg | PrefixLenReqMsg
                       | LoraLoadReqMsg | LoraUnloadReqMsg | LoraListReqMsg)
"""Requests answered by one QueryOutMsg."""


class EngineClient:
    """Owns the scheduler process and the two ZMQ sockets to it."""

    def __init__(self, config: EngineConfig, prepared: PreparedModel, tokenizer: Any) -> None:
        self.config = config
        self.prepared = prepared
        self.tokenizer = tokenizer
        self.model_config = prepared.config
        self.context_len = config.context_length or prepared.config.context_len
        self.server_info: dict[str, Any] = {}
        self._queues: dict[str, asyncio.Queue[TokenOut | KVExportMsg | RadixMeshError]] = {}
        self._queries: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._fatal: str | None = None
        self.on_kv_events: Callable[[KVEventsMsg], None] | None = None
        """Receives the radix cache's block events (only sent when config.kv_events_block_size > 0)."""
        self.on_lora_change: Callable[[list[str]], None] | None = None
        """Receives the loaded LoRA adapters' names after every load or unload that succeeded."""
        self._proc: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._ctx = zmq.asyncio.Context()
        self._ipc_dir = tempfile.mkdtemp(prefix="radixmesh-")
        self._send = self._ctx.socket(zmq.PUSH)
        self._recv = self._ctx.socket(zmq.PULL)

    @classmethod
    async def start(cls, config: EngineConfig) -> EngineClient:
        """Prepare the model (downloading/converting the default one if needed) and start the scheduler."""
        config = config.resolve()
        prepared = await asyncio.to_thread(prepare_model, config.model, config.load_format,
                                             tokenizer=config.tokenizer)
        # a clear error before any process starts
        check_tensor_parallel(prepared.config, config.tp_size, config.ep_size, config.enable_dp_attention)
        tokenizer = await asyncio.to_thread(load_tokenizer, prepared.tokenizer_path) \
            if prepared.tokenizer_path else None
        client = cls(config, prepared, tokenizer)
        await client._spawn()
        return client

    async def _spawn(self) -> None:
        to_sched = f"ipc://{self._ipc_dir}/to-scheduler"
        from_sched = f"ipc://{self._ipc_dir}/from-scheduler"
        self._send.bind(to_sched)
        self._recv.bind(from_sched)
        self._proc = self._scheduler_process(to_sched, from_sched)
        with spawn_env(self.config.device):
            self._proc.start()
        first = await self._wait_ready()
        if isinstance(first, FatalMsg):
            await self.shutdown()
            raise RadixMeshError(ErrorCode.UNAVAILABLE, first.message)
        self.server_info = first.info
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._watch_process())]

    def _scheduler_process(self, to_sched: str, from_sched: str) -> Any:
        """The (not yet started) scheduler process, which connects to the two addresses."""
        return mp.get_context("spawn").Process(target=run_scheduler_process, name="radixmesh-scheduler",
                                               args=(self.config, self.prepared, to_sched, from_sched), daemon=True)

    async def _wait_ready(self) -> ReadyMsg | FatalMsg:
        deadline = asyncio.get_running_loop().time() + STARTUP_TIMEOUT_S
        while asyncio.get_running_loop().time() < deadline:
            if await self._recv.poll(500):
                msg = from_scheduler_decoder.decode(await self._recv.recv())
                if isinstance(msg, ReadyMsg | FatalMsg):
                    return msg
            elif not self._proc.is_alive():
                return FatalMsg(f"the scheduler process exited with code {self._proc.exitcode} while starting")
        return FatalMsg("the scheduler process did not start in time")

    # ---- requests -----------------------------------------------------------------------------
    def validate(self, input_ids: list[int], params: SamplingParams, generates: bool = True,
                 mm: MultimodalInputs | None = None, lora: str | None = None) -> None:
        """Reject bad input before admission, naming the parameter (`validate_request`, and for a prompt
        with images `validate_images`); an adapter on a server without LoRA is NOT_FOUND."""
        if lora is not None and not self.config.lora_enabled:
            raise not_found(f"LoRA adapter {lora!r} is not loaded: this server serves no adapters (start it with "
                            "--lora-paths or --enable-lora)", "lora_path")
        if mm is not None:
            validate_images(input_ids, mm, params, self.model_config)
            input_ids = masked_text_ids(input_ids)
        validate_request(input_ids, params, self.model_config.vocab_size, self.context_len, generates)

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
                       mm: MultimodalInputs | None = None,
                       lora: str | None = None) -> AsyncGenerator[GenerationChunk, None]:
        """Stream one completion (of adapter `lora`; None: the base model); leaving the iterator early aborts the
        request and frees its KV."""
        self.validate(input_ids, params, mm=mm, lora=lora)
        rid = rid or uuid.uuid4().hex
        assembler = TextAssembler(self.tokenizer, params) if self.tokenizer is not None else None
        finished = False
        async for out in self._stream(GenerateReqMsg(rid, list(input_ids), params, mm=mm, lora=lora)):
            assert isinstance(out, TokenOut), "a Generate is answered by tokens only"
            finished = out.finish_reason is not None
            if assembler is not None:
                yield assembler.feed(out)
            else:
                yield GenerationChunk.of(out)
        assert finished

    async def generate_tokens(self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
                              prefill_only: bool = False, mm: MultimodalInputs | None = None,
                              output_ids: Sequence[int] = (),
                              lora: str | None = None) -> AsyncGenerator[TokenOut, None]:
        """Stream one request's token messages without text (for front ends that detokenize elsewhere).

        `prefill_only` computes and caches the prompt's KV and generates nothing. `output_ids`: tokens
        generated before (a migrated request): the request continues after them and streams only new
        ones. Leaving the iterator early aborts the request and frees its KV.
        """
        self.validate(input_ids, SamplingParams() if prefill_only else params, generates=not prefill_only, mm=mm,
                      lora=lora)
        if prefill_only:
            params = SamplingParams(max_new_tokens=0)
        validate_resume(output_ids, params, self.model_config.vocab_size)
        msg = GenerateReqMsg(rid or uuid.uuid4().hex, list(input_ids), params, prefill_only, mm=mm,
                             output_ids=list(output_ids), lora=lora)
        async for out in self._stream(msg):
            assert isinstance(out, TokenOut), "a Generate is answered by tokens only"
            yield out

    async def cache_prefix(self, input_ids: list[int], mm: MultimodalInputs | None = None,
                           lora: str | None = None) -> None:
        """Compute and cache a prompt's KV without generating (shared by n > 1 branches)."""
        params = SamplingParams(max_new_tokens=0)
        msg = GenerateReqMsg(uuid.uuid4().hex, list(input_ids), params, True, mm=mm, lora=lora)
        async for _ in self._stream(msg):
            pass

    def branch_params(self, params: SamplingParams) -> list[SamplingParams]:
        """n > 1: one parameter set per branch, each with its own derived seed."""
        if params.n == 1:
            return [params]
        return [msgspec.structs.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
                for i in range(params.n)]

    def stream(self, msg: StreamedMsg) -> AsyncGenerator[TokenOut | KVExportMsg, None]:
        """Send `msg` and stream what answers it (for front ends of the disaggregation messages)."""
        return self._stream(msg)

    async def _stream(self, msg: StreamedMsg) -> AsyncGenerator[TokenOut | KVExportMsg, None]:
        """Send `msg` and yield what answers it until its last TokenOut; leaving early aborts `msg.rid`."""
        self._check_alive()
        queue: asyncio.Queue[TokenOut | KVExportMsg | RadixMeshError] = asyncio.Queue()
        self._queues[msg.rid] = queue
        done = False
        try:
            await self._send.send(encoder.encode(msg))
            while not done:
                item = await queue.get()
                if isinstance(item, RadixMeshError):
                    raise item
                if isinstance(item, KVExportMsg):
                    yield item
                    continue
                if item.finish_reason == "error":
                    code = ErrorCode(item.error_code or "invalid_argument")
                    raise RadixMeshError(code, item.error or "request failed")
                done = item.finish_reason is not None
                yield item
        finally:
            self._queues.pop(msg.rid, None)
            if not done and self._fatal is None:
                await self.abort(msg.rid)

    async def abort(self, rid: str) -> None:
        if self._fatal is None:
            await self._send.send(encoder.encode(AbortReqMsg(rid)))

    async def send(self, msg: Any) -> None:
        """Send a message that has no answer (a KV chunk, a cancellation, a release) to the scheduler."""
        self._check_alive()
        await self._send.send(encoder.encode(msg), copy=False)

    async def flush_cache(self) -> bool:
        return bool((await self.query(FlushCacheReqMsg(uuid.uuid4().hex)))["success"])

    async def get_server_info(self) -> dict[str, Any]:
        return await self.query(ServerInfoReqMsg(uuid.uuid4().hex))

    async def lora_query(self, msg: LoraLoadReqMsg | LoraUnloadReqMsg | LoraListReqMsg) -> dict[str, Any]:
        """Load, unload or list adapters (`radixmesh.engine.lora.hook`); its error as a RadixMeshError."""
        if not self.config.lora_enabled:
            if isinstance(msg, LoraListReqMsg):
                return {"adapters": []}
            raise invalid_argument("this server serves no LoRA adapters: start it with --enable-lora or "
                                   "--lora-paths", "lora_name")
        result = await self.query(msg, timeout_s=max(QUERY_TIMEOUT_S, 120.0))
        if "error" in result:
            raise RadixMeshError(ErrorCode(result["code"]), result["error"], "lora_name")
        return result

    async def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        info = await self.lora_query(LoraLoadReqMsg(uuid.uuid4().hex, name, path))
        await self._lora_changed()
        return info

    async def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        result = await self.lora_query(LoraUnloadReqMsg(uuid.uuid4().hex, name))
        await self._lora_changed()
        return result

    async def _lora_changed(self) -> None:
        if self.on_lora_change is not None:  # a load may also have dropped the least recently used adapter
            self.on_lora_change([a["name"] for a in await self.list_lora_adapters()])

    async def list_lora_adapters(self) -> list[dict[str, Any]]:
        return list((await self.lora_query(LoraListReqMsg(uuid.uuid4().hex)))["adapters"])

    async def query(self, msg: QueryMsg, timeout_s: float = QUERY_TIMEOUT_S) -> dict[str, Any]:
        """Send `msg` and wait for its one answer (UNAVAILABLE when the engine dies meanwhile)."""
        self._check_alive()
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._queries[msg.query_id] = fut
        await self._send.send(encoder.encode(msg))
        try:
            return await aio.wait_for(fut, timeout_s)
        finally:
            self._queries.pop(msg.query_id, None)

    # ---- background ---------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            msg = from_scheduler_decoder.decode(await self._recv.recv())
            if isinstance(msg, BatchOutMsg):
                for out in msg.outputs:
                    queue = self._queues.get(out.rid)
                    if queue is not None:
                        queue.put_nowait(out)
            elif isinstance(msg, KVExportMsg):
                queue = self._queues.get(msg.rid)
                if queue is not None:
                    queue.put_nowait(msg)
            elif isinstance(msg, QueryOutMsg):
                fut = self._queries.get(msg.query_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg.result)
            elif isinstance(msg, KVEventsMsg):
                if self.on_kv_events is not None:
                    self.on_kv_events(msg)
            elif isinstance(msg, FatalMsg):
                self._die(msg.message)
                return

    async def _watch_process(self) -> None:
        while self._proc.is_alive():
            await asyncio.sleep(1.0)
        self._die(f"the scheduler process exited with code {self._proc.exitcode}")

    def _die(self, message: str) -> None:
        if self._fatal is not None:
            return
        self._fatal = message
        logger.error("engine failed: %s", message)
        err = RadixMeshError(ErrorCode.UNAVAILABLE, message)
        for queue in self._queues.values():
            queue.put_nowait(err)
        for fut in self._queries.values():
            if not fut.done():
                fut.set_exception(err)

    def _check_alive(self) -> None:
        if self._fatal is not None:
            raise RadixMeshError(ErrorCode.UNAVAILABLE, f"the engine is not running: {self._fatal}")

    @property
    def is_alive(self) -> bool:
        return self._fatal is None and self._proc is not None and self._proc.is_alive()

    async def shutdown(self) -> None:
        """Stop the scheduler process (gracefully, then by force) and close the sockets."""
        for task in self._tasks:
            task.cancel()
        if self._proc is not None and self._proc.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                await self._send.send(encoder.encode(ShutdownReqMsg()))
            await asyncio.to_thread(self._proc.join, 10)
            if self._proc.is_alive():
                self._proc.terminate()
                await asyncio.to_thread(self._proc.join, 5)
        self._fatal = self._fatal or "shut down"
        self._send.close(0)
        self._recv.close(0)
        self._ctx.term()
        with contextlib.suppress(OSError):
            for name in os.listdir(self._ipc_dir):
                os.unlink(os.path.join(self._ipc_dir, name))
            os.rmdir(self._ipc_dir)

    def describe(self) -> dict[str, Any]:
        return {"model_name": self.prepared.name, "model_path": str(self.prepared.model_path or ""),
                "context_len": self.context_len, "config": dataclasses.asdict(self.config)}
