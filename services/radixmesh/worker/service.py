"""WorkerService over one EngineClient: token ids in, token ids out (the worker never detokenizes)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path

import grpc.aio
import msgspec

from radixmesh.common.drain import StreamDrain
from radixmesh.common.errors import invalid_argument, not_found
from radixmesh.common.grpc_errors import map_errors
from radixmesh.engine.client import EngineClient
from radixmesh.engine.loader.default_model import DEFAULT_MODEL_ALIASES, DEFAULT_MODEL_NAME
from radixmesh.protocol import common_pb2, worker_pb2, worker_pb2_grpc
from radixmesh.wire.convert import (
    ROLE_TO_PROTO,
    disagg_stats_to_proto,
    images_from_proto,
    sampling_from_proto,
    token_out_to_proto,
)
from radixmesh.wire.images import MultimodalInputs
from radixmesh.wire.load import WorkerLoad, load_to_proto
from radixmesh.wire.lora_info import adapter_info_to_proto, load_result_to_proto
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.sampling import SamplingParams
from radixmesh.worker import metrics
from radixmesh.worker.config import WorkerConfig
from radixmesh.worker.disagg_decode import DecodeFlow
from radixmesh.worker.disagg_prefill import PrefillFlow
from radixmesh.worker.load import LoadTracker
from radixmesh.worker.peer_export import PeerExportFlow
from radixmesh.worker.peer_fetch import PeerFetchFlow
from radixmesh.worker.timeline import RequestTimeline

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name


def may_fetch_from_peers(config: WorkerConfig) -> bool:
    return config.role != "prefill" and config.peer_fetch != "off"


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Streams a sequence's tokens from the scheduler process; cancelling the call aborts it."""

    def __init__(self, client: EngineClient, config: WorkerConfig) -> None:
        self.client = client
        self.config = config
        self.load = LoadTracker()
        self.decode = DecodeFlow(client, config) if config.role == "decode" else None
        """Generate calls naming a prefill worker (decode role only)."""
        self.prefill = PrefillFlow(client, config, self.load) if config.role == "prefill" else None
        """Prefill calls (prefill role only)."""
        self.peer_fetch = PeerFetchFlow(client, config) if may_fetch_from_peers(config) else None
        """Generate calls naming a peer that holds a prefix (prefix sharing; unified and decode roles, unless
        --peer-fetch off: such calls then compute the prefix here)."""
        self.index_epoch: Callable[[], int] = lambda: 0
        """This worker's current KV-cache index epoch (set once its publisher runs; 0: none)."""
        self.lane_port = 0
        """The port of this worker's Generate lane, reported by GetLoad (set once the server runs; 0: none)."""
        self.http_port = 0
        """The port of this worker's OpenAI HTTP API, reported by GetLoad (set once it listens; 0: none)."""
        self.peer_export = PeerExportFlow(client, config, lambda: self.index_epoch())
        """FetchKV calls: cached prefixes sent to peers (every role)."""
        self.drain = StreamDrain(f"worker {config.worker_id or 'starting'}")
        """SIGTERM: new Generate calls end DRAINING, running ones finish or are cut (radixmesh.common.drain)."""

    def resolve(self, listen_address: str) -> WorkerConfig:
        """Fill the worker id and advertise address once the server bound its address."""
        self.config = self.config.resolve(listen_address)
        for flow in (self.decode, self.prefill, self.peer_fetch, self.peer_export):
            if flow is not None:
                flow.config = self.config
        self.drain.service = f"worker {self.config.worker_id}"
        return self.config

    async def drain_streams(self, timeout_s: float) -> int:
        """On SIGTERM: refuse new sequences, let running ones finish within `timeout_s`, cut the rest."""
        return await self.drain.run(lambda: self.load.active, self._abort, timeout_s)

    @map_errors("worker")
    async def Generate(self, request: worker_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.GenerateResponse]:
        self.drain.refuse_new()
        params = sampling_from_proto(request.sampling_params)
        if params.n != 1:
            raise invalid_argument("a Generate call is one sequence: n must be 1 (split branches before)", "n")
        rid = request.request_id or uuid.uuid4().hex
        if rid in self.load.active:
            raise invalid_argument(f"request id {rid!r} is already running on this worker", "request_id")
        ids = list(request.token_ids)
        start, worker_id = time.perf_counter(), self.config.worker_id
        timeline = RequestTimeline(rid, len(ids), {"radixmesh.worker_id": worker_id,
                                                   "radixmesh.role": self.config.role})
        metrics.RUNNING.inc()
        try:
            with self.load.track(rid, len(ids)) as seq:
                stream = self._tokens(request, ids, params, rid, images_from_proto(request.images))
                engine_start = time.perf_counter()
                async with contextlib.aclosing(stream) as outs:
                    async for out in outs:
                        if out.finish_reason == "abort" and self.drain.was_cut(rid):
                            if out.token_ids:  # what the engine had not sent yet, then the call ends DRAINING
                                yield token_out_to_proto(msgspec.structs.replace(out, finish_reason=None), worker_id)
                            raise self.drain.cut_error()
                        timeline.on_output(out)
                        first = not seq.started
                        if first:
                            metrics.TTFT.observe(time.perf_counter() - start)
                        self.load.update(seq, len(out.token_ids))
                        metrics.GENERATED_TOKENS.inc(len(out.token_ids))
                        if out.finish_reason is not None:
                            _count_finished(out.finish_reason, out.prompt_tokens, out.cached_tokens, start)
                        if request.lora_name:
                            _count_adapter(request.lora_name, len(out.token_ids), out.finish_reason is not None)
                        msg = token_out_to_proto(out, worker_id)
                        if first:
                            msg.engine_ttft_s = time.perf_counter() - engine_start
                        if worker_id and self.peer_fetch is not None:
                            msg.fetched_tokens = self.peer_fetch.take_fetched(rid)
                        yield msg
                        worker_id = ""  # named on the first message only
        finally:
            metrics.RUNNING.dec()
            timeline.close()
            self._observe_prefill_rate(timeline)

    def _tokens(self, request: worker_pb2.GenerateRequest, ids: list[int], params: SamplingParams,
                rid: str, mm: MultimodalInputs | None) -> AsyncGenerator[TokenOut, None]:
        lora = request.lora_name or None
        if request.resume_output_ids:  # a migrated sequence: prompt and output are computed here
            return self.client.generate_tokens(ids, params, rid, mm=mm, output_ids=list(request.resume_output_ids),
                                               lora=lora)
        plain = mm is None and lora is None  # adapters' sequences are computed here, never handed over
        if self.decode is not None and request.HasField("prefill") and not request.prefill_only and plain:
            return self.decode.generate(rid, ids, params, request.prefill)
        if (self.peer_fetch is not None and request.HasField("peer_prefix") and not request.prefill_only
                and plain):
            return self.peer_fetch.generate(rid, ids, params, request.peer_prefix)
        if mm is None and lora is None:
            return self.client.generate_tokens(ids, params, rid, request.prefill_only)
        return self.client.generate_tokens(ids, params, rid, request.prefill_only, mm=mm, lora=lora)

    def _observe_prefill_rate(self, timeline: RequestTimeline) -> None:
        """Feed the prefix-sharing cost model this worker's own prefill rate (admission to first token)."""
        if self.peer_fetch is None or timeline.admitted_ns is None or timeline.first_token_ns is None:
            return
        computed = timeline.prompt_len - timeline.cached_tokens
        self.peer_fetch.costs.observe_prefill(computed, (timeline.first_token_ns - timeline.admitted_ns) / 1e9)

    @map_errors("worker")
    async def Prefill(self, request_iterator: AsyncIterator[worker_pb2.PrefillRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.PrefillResponse]:
        if self.prefill is None:
            raise invalid_argument(f"this worker's role is {self.config.role}: Prefill calls go to prefill workers",
                                   "role")
        metrics.RUNNING.inc()
        try:
            async with contextlib.aclosing(self.prefill.serve(request_iterator)) as msgs:
                async for msg in msgs:
                    yield msg
        finally:
            metrics.RUNNING.dec()

    @map_errors("worker")
    async def FetchKV(self, request_iterator: AsyncIterator[worker_pb2.FetchKVRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.FetchKVResponse]:
        async with contextlib.aclosing(self.peer_export.serve(request_iterator)) as msgs:
            async for msg in msgs:
                yield msg

    @map_errors("worker")
    async def Abort(self, request: worker_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.AbortResponse:
        found = request.request_id in self.load.active
        if found:
            await self._abort(request.request_id)
        return worker_pb2.AbortResponse(found=found)

    async def _abort(self, rid: str) -> None:
        if self.decode is not None:
            self.decode.abort(rid)  # still waiting for its prefill worker: stop that too
        await self.client.abort(rid)

    @map_errors("worker")
    async def GetLoad(self, request: worker_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.GetLoadResponse:
        stats = await self.client.get_server_info()
        stats["num_queued_prefill_tokens"] = self.load.num_queued_prefill_tokens
        stats["num_running_decode_tokens"] = self.load.num_running_decode_tokens
        metrics.ENGINE_STATS.update(stats)
        return worker_pb2.GetLoadResponse(worker_id=self.config.worker_id, role=ROLE_TO_PROTO[self.config.role],
                                          load=load_to_proto(WorkerLoad.from_stats(stats)),
                                          disagg=disagg_stats_to_proto(stats, self.config.kv_transport),
                                          lane_port=self.lane_port, http_port=self.http_port,
                                          draining=self.drain.draining)

    @map_errors("worker")
    async def FlushCache(self, request: worker_pb2.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> worker_pb2.FlushCacheResponse:
        return worker_pb2.FlushCacheResponse(flushed=await self.client.flush_cache())

    @map_errors("worker")
    async def GetModelInfo(self, request: worker_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> worker_pb2.GetModelInfoResponse:
        client, prepared = self.client, self.client.prepared
        info = client.server_info
        return worker_pb2.GetModelInfoResponse(
            model_name=prepared.name, model_path=str(prepared.model_path or ""), context_len=client.context_len,
            vocab_size=client.model_config.vocab_size,
            max_running_requests=int(info.get("max_running_requests", client.config.max_running_requests)),
            max_total_tokens=int(info.get("max_total_num_tokens", 0)), worker_id=self.config.worker_id,
            role=ROLE_TO_PROTO[self.config.role], block_size=self.config.block_size,
            aliases=sorted(model_aliases(client) - {prepared.name}),
            engine_config_json=json.dumps(dataclasses.asdict(client.config), default=str),
            has_image_understanding=client.model_config.is_multimodal)

    @map_errors("worker")
    async def LoadLoraAdapter(self, request: common_pb2.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext) -> common_pb2.LoadLoraAdapterResponse:
        self._check_named(request.worker_id)
        info = await self.client.load_lora_adapter(request.name, request.path)
        return load_result_to_proto(request.name, info)

    @map_errors("worker")
    async def UnloadLoraAdapter(self, request: common_pb2.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> common_pb2.UnloadLoraAdapterResponse:
        self._check_named(request.worker_id)
        await self.client.unload_lora_adapter(request.name)
        return common_pb2.UnloadLoraAdapterResponse()

    @map_errors("worker")
    async def ListLoraAdapters(self, request: common_pb2.ListLoraAdaptersRequest,
                               context: grpc.aio.ServicerContext) -> common_pb2.ListLoraAdaptersResponse:
        adapters = await self.client.list_lora_adapters()
        return common_pb2.ListLoraAdaptersResponse(adapters=[adapter_info_to_proto(a)
                                                             for a in sorted(adapters, key=lambda a: a["name"])])

    def _check_named(self, worker_id: str) -> None:
        """A call naming a worker (meant for a router) reaches this one only if it is the one named."""
        if worker_id and worker_id != self.config.worker_id:
            raise not_found(f"no worker {worker_id!r} here (this is worker {self.config.worker_id!r})", "worker_id")

    async def close(self) -> None:
        for flow in (self.decode, self.peer_fetch):
            if flow is not None:
                await flow.close()


def _count_finished(reason: str, prompt_tokens: int, cached_tokens: int, start: float) -> None:
    metrics.REQUESTS.labels(reason).inc()
    metrics.PROMPT_TOKENS.inc(prompt_tokens)
    metrics.CACHED_TOKENS.inc(cached_tokens)
    metrics.E2E.observe(time.perf_counter() - start)


def _count_adapter(name: str, num_tokens: int, finished: bool) -> None:
    metrics.LORA_TOKENS.labels(name).inc(num_tokens)
    if finished:
        metrics.LORA_FINISHED.labels(name).inc()


def model_aliases(client: EngineClient) -> set[str]:
    """Every name a client may use for the served model (as `radixmesh serve` accepts)."""
    prepared = client.prepared
    aliases = {prepared.name}
    if client.config.model:
        aliases.add(client.config.model)
    if prepared.model_path is not None:
        aliases |= {str(prepared.model_path), Path(prepared.model_path).name}
    if prepared.name == DEFAULT_MODEL_NAME:
        aliases |= DEFAULT_MODEL_ALIASES
    return aliases
