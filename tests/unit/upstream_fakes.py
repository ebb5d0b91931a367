"""Stand-ins for the cluster gateway's upstreams: failed gRPC calls, Generate streams, router replicas, a watcher."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.common.grpc_errors import ERROR_METADATA_KEY, error_detail_bytes, to_grpc_status
from radixmesh.gateway.generate_upstream import GenerateUpstream
from radixmesh.gateway.upstreams import UpstreamGroup
from radixmesh.protocol import common_pb2, worker_pb2


class RpcFailure(grpc.RpcError):
    """A failed call as grpc raises it: a status code, details, and (from a radixmesh service) an error trailer."""

    def __init__(self, code: grpc.StatusCode, details: str = "", own: bool = False) -> None:
        self._code, self._details = code, details
        own_code = next((c for c in ErrorCode if to_grpc_status(RadixMeshError(c, details))[0] == code),
                        ErrorCode.INTERNAL)
        self._trailer = ((ERROR_METADATA_KEY, error_detail_bytes(RadixMeshError(own_code, details))),) if own else ()

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return self._trailer


class FakeCall:
    """A Generate stream: its messages, then EOF, or a failure after `fail_after` messages."""

    def __init__(self, messages: list[Any], fail_after: int | None = None, error: Exception | None = None) -> None:
        self.messages, self.fail_after, self.error = list(messages), fail_after, error
        self.read_count = 0
        self.cancelled = False

    async def read(self) -> Any:
        if self.fail_after is not None and self.read_count >= self.fail_after:
            assert self.error is not None
            raise self.error
        self.read_count += 1
        return self.messages.pop(0) if self.messages else grpc.aio.EOF

    def cancel(self) -> None:
        self.cancelled = True


class FakeReplica:
    """A router replica: what its stub answers, and what it was asked."""

    def __init__(self, address: str, call: FakeCall | None = None, up: bool = True) -> None:
        self.kind, self.address, self.up, self.detail, self.lane = "router", address, up, "", None
        self.call = call or FakeCall([])
        self.log: list[str] = []
        self.wake = asyncio.Event()
        replica = self

        class Stub:
            def Generate(self, request: Any) -> FakeCall:
                replica.log.append(f"generate {request.request_id}")
                return replica.call

            async def Abort(self, request: Any, timeout: float) -> Any:
                replica.log.append(f"abort {request.request_id}")
                return worker_pb2.AbortResponse()

            async def GetLoad(self, request: Any, timeout: float) -> Any:
                return worker_pb2.GetLoadResponse(load=common_pb2.WorkerLoad(num_running_reqs=2, kv_usage=0.5))

            async def FlushCache(self, request: Any, timeout: float) -> Any:
                return worker_pb2.FlushCacheResponse(flushed=True)

        self.stub = Stub()

    @property
    def description(self) -> str:
        return f"the router at {self.address}"


class Watcher:
    def __init__(self) -> None:
        self.down: list[str] = []

    def mark_down(self, group: Any, upstream: Any, detail: str) -> None:
        self.down.append(upstream.address)
        upstream.up = False


def generation(*replicas: FakeReplica, reason: str = "no router answers") -> tuple[GenerateUpstream, Watcher]:
    gen = GenerateUpstream("127.0.0.1:1", "router", lambda: reason, target=replicas[0])  # type: ignore[arg-type]
    gen.group = UpstreamGroup("router", list(replicas))  # type: ignore[arg-type]
    watcher = Watcher()
    gen.watcher = watcher  # type: ignore[assignment]
    return gen, watcher


def request(rid: str = "r") -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=rid, token_ids=[1, 2])


async def drain(gen: GenerateUpstream, rid: str = "r") -> list[Any]:
    return [msg async for msg in gen.stream(request(rid))]


def response(*ids: int) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(token_ids=list(ids))
