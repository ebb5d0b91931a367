"""An in-process WorkerService without a model, for router tests: scripted streams over real gRPC.

Each fake answers Generate with `num_tokens` messages (token ids 0, 1, ...), reports as cached
the prompt blocks it already served (so placement is observable), and, when given a Redis
URL, publishes those blocks to the KV-cache index like a real worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc.aio

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.common.grpc_errors import abort_with
from radixmesh.common.grpc_server import GrpcServer, GrpcServerConfig
from radixmesh.common.lane import LaneContext, LaneMethod
from radixmesh.index.config import IndexConfig
from radixmesh.index.writer import KVIndexWriter, WriterIdentity
from radixmesh.protocol import common_pb2, worker_pb2, worker_pb2_grpc
from radixmesh.wire.block_hash import block_hashes

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
BLOCK = 16


class FakeWorker(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, name: str, redis_url: str | None = None, lane: bool = True, port: int = 0) -> None:
        """`lane`: serve Generate on a lane too and report it in GetLoad (as a worker does); `port`: 0 picks one."""
        self.name = name
        self.redis_url = redis_url
        self.server = GrpcServer(GrpcServerConfig(port=port, metrics_port=-1, lane_port=0 if lane else -1),
                                 f"fake-{name}", [SERVICE_NAME])
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(self, self.server.server)
        self.server.add_lane({"Generate": LaneMethod(worker_pb2.GenerateRequest, self.Generate,
                                                     f"/{SERVICE_NAME}/Generate")})
        self.mode = "ok"
        """ok | refuse (UNAVAILABLE before any message) | fail-mid (UNAVAILABLE after `fail_after` messages)
        | drain-mid (DRAINING after `fail_after` messages) | hang-mid (first message, then never finishes)."""
        self.fail_after = 1
        self.num_tokens = 3
        self.delay_s = 0.0
        self.requests: list[worker_pb2.GenerateRequest] = []
        self.transports: list[str] = []
        """How each Generate arrived: lane | grpc."""
        self.aborted: list[str] = []
        self.held: set[int] = set()
        self.writer: KVIndexWriter | None = None
        self.running: dict[str, asyncio.Event] = {}
        self.http_port = 0
        """The HTTP API port GetLoad reports (a picker's tests: nothing listens unless the test serves it)."""
        self.num_waiting = 0
        """Requests GetLoad reports as waiting."""

    @property
    def address(self) -> str:
        return self.server.address

    async def start(self) -> FakeWorker:
        await self.server.start()
        if self.redis_url:
            config = IndexConfig(redis_url=self.redis_url, block_size=BLOCK, flush_interval_s=0.005)
            self.writer = KVIndexWriter(config, WriterIdentity(self.address, self.address))
            await self.writer.start()
        return self

    async def stop(self) -> None:
        if self.writer is not None:
            await self.writer.close()
        await self.server.stop()

    async def Generate(self, request: worker_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.GenerateResponse]:
        self.requests.append(request)
        self.transports.append("lane" if isinstance(context, LaneContext) else "grpc")
        if self.mode == "refuse":
            await abort_with(context, RadixMeshError(ErrorCode.UNAVAILABLE, f"{self.name} refuses"), "worker")
        hashes = block_hashes(list(request.token_ids), BLOCK)
        cached = 0
        while cached < len(hashes) and hashes[cached] in self.held:
            cached += 1
        self.held.update(hashes)
        if self.writer is not None:
            self.writer.stored(hashes)
            await self.writer.wait_published()
        aborted = self.running[request.request_id] = asyncio.Event()
        first = len(request.resume_output_ids)  # a migrated sequence continues after the tokens it had
        try:
            for i in range(first, self.num_tokens):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if aborted.is_set():
                    yield self._msg(request, i, cached * BLOCK, common_pb2.FINISH_REASON_ABORT)
                    return
                last = i == self.num_tokens - 1
                yield self._msg(request, i, cached * BLOCK, common_pb2.FINISH_REASON_LENGTH if last else 0)
                if self.mode in ("fail-mid", "drain-mid") and i + 1 - first >= self.fail_after and not last:
                    code = ErrorCode.UNAVAILABLE if self.mode == "fail-mid" else ErrorCode.DRAINING
                    await abort_with(context, RadixMeshError(code, f"{self.name} died"), "worker")
                if self.mode == "hang-mid":
                    await asyncio.Event().wait()
        finally:
            self.running.pop(request.request_id, None)

    def _msg(self, request: worker_pb2.GenerateRequest, i: int, cached: int,
             finish: int) -> worker_pb2.GenerateResponse:
        return worker_pb2.GenerateResponse(request_id=request.request_id, token_ids=[i],
                                           prompt_tokens=len(request.token_ids), cached_tokens=cached,
                                           completion_tokens=i + 1, finish_reason=finish,
                                           worker_id=self.address if i == len(request.resume_output_ids) else "")

    async def Abort(self, request: worker_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.AbortResponse:
        event = self.running.get(request.request_id)
        self.aborted.append(request.request_id)
        if event is not None:
            event.set()
        return worker_pb2.AbortResponse(found=event is not None)

    async def GetLoad(self, request: worker_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.GetLoadResponse:
        load = common_pb2.WorkerLoad(num_running_reqs=len(self.running), num_waiting_reqs=self.num_waiting,
                                     max_total_tokens=10_000, kv_used_tokens=100, kv_usage=0.01)
        return worker_pb2.GetLoadResponse(worker_id=self.address, role=common_pb2.WORKER_ROLE_UNIFIED, load=load,
                                          lane_port=self.server.lane_port, http_port=self.http_port)

    async def FlushCache(self, request: worker_pb2.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> worker_pb2.FlushCacheResponse:
        self.held.clear()
        if self.writer is not None:
            self.writer.cleared()
        return worker_pb2.FlushCacheResponse(flushed=True)

    async def GetModelInfo(self, request: worker_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> worker_pb2.GetModelInfoResponse:
        return worker_pb2.GetModelInfoResponse(model_name="fake", context_len=2048, vocab_size=1000,
                                               worker_id=self.address, block_size=BLOCK)
