"""The router's gRPC client of one worker: Generate stream, probes, and the control RPCs.

Every failure comes out as a `RadixMeshError` (rebuilt from the worker's error trailer when
there is one), so the dispatch logic never sees a transport exception.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixmesh.common import tls, tracing
from radixmesh.common.errors import RadixMeshError
from radixmesh.common.grpc_errors import from_rpc_error
from radixmesh.common.grpc_server import MAX_MESSAGE_BYTES
from radixmesh.common.lane import PeerLane
from radixmesh.protocol import common_pb2, worker_pb2, worker_pb2_grpc
from radixmesh.router.discovery.base import WorkerEndpoint
from radixmesh.wire.convert import ROLE_FROM_PROTO
from radixmesh.wire.load import WorkerLoad, load_from_proto

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


@dataclass(frozen=True)
class ProbeResult:
    """One active health check: grpc.health.v1 Check, then GetLoad."""

    ok: bool
    """SERVING and GetLoad answered."""
    error: str = ""
    """Why not, when not ok."""
    load: WorkerLoad | None = None
    """The load GetLoad reported."""
    worker_id: str = ""
    """The id the worker reports (its index id)."""
    role: str = ""
    """The role the worker reports (unified | prefill | decode; "" when unknown)."""
    http_port: int = 0
    """The port of the worker's OpenAI HTTP API on its host (0: none)."""
    disagg: worker_pb2.DisaggStats | None = None
    """Its KV transfer counters (for the router's GetLoad)."""
    draining: bool = False
    """The worker drains (SIGTERM): it leaves routing at once, whatever the failure threshold."""


class WorkerClient:
    def __init__(self, endpoint: WorkerEndpoint, use_lane: bool = True) -> None:
        """`use_lane`: send Generate over the worker's lane once a probe learns its port (never with TLS)."""
        self.endpoint = endpoint
        self.channel = tls.aio_channel(endpoint.address, options=CHANNEL_OPTIONS,
                                       interceptors=tracing.client_interceptors())
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.lane = PeerLane(endpoint.address, f"worker {endpoint.worker_id}") \
            if use_lane and tls.client_tls() is None else None
        """The worker's Generate lane, learnt from its GetLoad replies (None: Generate always over gRPC)."""

    def _error(self, exc: grpc.RpcError) -> RadixMeshError:
        return from_rpc_error(exc, peer=f"worker {self.endpoint.worker_id} at {self.endpoint.address}")

    async def generate(self, request: worker_pb2.GenerateRequest) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """The worker's stream; closing the iterator early cancels the call (the worker aborts)."""
        stream = None if self.lane is None else await self.lane.open(
            "Generate", request, worker_pb2.GenerateResponse, f"/{WORKER_SERVICE}/Generate")
        if stream is not None:
            try:
                while (msg := await stream.read()) is not None:
                    yield msg
            finally:
                stream.cancel()
            return
        call = self.stub.Generate(request)
        try:
            async for msg in call:
                yield msg
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        finally:
            if not call.done():
                call.cancel()

    async def probe(self, timeout_s: float) -> ProbeResult:
        """Health from grpc.health.v1 (answered by the front end even while the engine is busy); the load
        from GetLoad, best effort: a busy scheduler may answer late, which leaves the last load in place."""
        try:
            health = await self.health.Check(health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if self.lane is not None:
                self.lane.forget_refusal()
            return ProbeResult(False, f"{exc.code().name}: {exc.details()}")
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
            return ProbeResult(False, f"health status {status}")
        try:
            reply = await self.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return ProbeResult(True, f"GetLoad: {exc.code().name}")
        if reply.draining:
            return ProbeResult(False, "draining", draining=True)
        if self.lane is not None:
            self.lane.learn(reply.lane_port)
        return ProbeResult(True, load=load_from_proto(reply.load), worker_id=reply.worker_id,
                           role=ROLE_FROM_PROTO.get(reply.role, ""), http_port=reply.http_port,
                           disagg=reply.disagg)

    async def watch_serving(self) -> AsyncIterator[bool]:
        """grpc.health.v1 Watch of the worker's service: whether it serves, now and at each change (a worker
        that drains turns NOT_SERVING at once); raises RadixMeshError when the stream breaks."""
        call = self.health.Watch(health_pb2.HealthCheckRequest(service=WORKER_SERVICE))
        try:
            async for reply in call:
                yield reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        finally:
            if not call.done():
                call.cancel()

    async def abort(self, request_id: str, timeout_s: float = 5.0) -> bool:
        try:
            reply = await self.stub.Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        return bool(reply.found)

    async def flush_cache(self, timeout_s: float = 30.0) -> bool:
        try:
            reply = await self.stub.FlushCache(worker_pb2.FlushCacheRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        return bool(reply.flushed)

    async def get_model_info(self, timeout_s: float = 10.0) -> worker_pb2.GetModelInfoResponse:
        try:
            reply: worker_pb2.GetModelInfoResponse = await self.stub.GetModelInfo(worker_pb2.GetModelInfoRequest(),
                                                                                   timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        return reply

    async def load_lora_adapter(self, name: str, path: str,
                                timeout_s: float = 120.0) -> common_pb2.LoadLoraAdapterResponse:
        try:
            reply: common_pb2.LoadLoraAdapterResponse = await self.stub.LoadLoraAdapter(
                common_pb2.LoadLoraAdapterRequest(name=name, path=path), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        return reply

    async def unload_lora_adapter(self, name: str, timeout_s: float = 30.0) -> None:
        try:
            await self.stub.UnloadLoraAdapter(common_pb2.UnloadLoraAdapterRequest(name=name), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None

    async def list_lora_adapters(self, timeout_s: float = 10.0) -> list[common_pb2.LoraAdapterInfo]:
        try:
            reply: common_pb2.ListLoraAdaptersResponse = await self.stub.ListLoraAdapters(
                common_pb2.ListLoraAdaptersRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        return list(reply.adapters)

    async def close(self) -> None:
        if self.lane is not None:
            await self.lane.close()
        await self.channel.close()
