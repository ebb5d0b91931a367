"""The Generate side of the cluster gateway: routers (one or more replicas) or one worker.

A request starts on the first ready replica; a replica that fails before streaming anything (unreachable,
UNAVAILABLE or DRAINING) is skipped for the next one. With several router replicas, one that dies or drains
mid-stream hands the stream to another (failover.py); other later failures are the request's. Generate rides
the replica's lane when it has one that answers (radixmesh.common.lane), else gRPC. Aborts go to the replica
running the request, control calls (flush, load, model info) to a ready one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

import grpc
import grpc.aio

from radixmesh.common.errors import ErrorCode, RadixMeshError, invalid_argument
from radixmesh.common.grpc_errors import ERROR_METADATA_KEY, from_rpc_error
from radixmesh.common.lane import LaneBroken, LaneStream
from radixmesh.gateway import failover
from radixmesh.gateway.upstreams import Upstream, UpstreamGroup, UpstreamWatcher, not_ready_error, parse_addresses
from radixmesh.protocol import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from radixmesh.wire.convert import disagg_stats_from_proto
from radixmesh.wire.load import WorkerLoad, load_from_proto

logger = logging.getLogger(__name__)
CONTROL_TIMEOUT_S = 30.0
LORA_TIMEOUT_S = 150.0
"""Loading an adapter reads and checks its files on every worker (a worker allows itself 120 s)."""


class GenerateUpstream:
    """The Generate targets: `target_kind` "router" (one or more replicas) or "worker" (exactly one).

    `target`: a target built elsewhere (the router in this process) instead of `target_address`'s; `transport`:
    how Generate reaches the targets (lane | grpc). `not_ready_reason` says why nothing is ready (for 503s).
    """

    def __init__(self, target_address: str, target_kind: str, not_ready_reason: Callable[[], str],
                 target: Upstream | None = None, transport: str = "lane") -> None:
        assert target_kind in ("router", "worker"), f"target_kind {target_kind!r} is not router or worker"
        addresses = [target.address] if target is not None else parse_addresses(target_address, target_kind)
        if target_kind == "worker" and len(addresses) > 1:
            raise invalid_argument("--worker takes one worker; put a router in front of several", "worker")
        self.target_kind = target_kind
        self.target_address = ",".join(addresses)
        self.not_ready_reason = not_ready_reason
        stub_class = router_pb2_grpc.RouterServiceStub if target_kind == "router" else worker_pb2_grpc.WorkerServiceStub
        self._service_name = (router_pb2.DESCRIPTOR.services_by_name["RouterService"] if target_kind == "router"
                              else worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]).full_name
        """The target's gRPC service (names the lane's spans as gRPC's interceptor names the calls')."""
        self.group = UpstreamGroup(target_kind, [target] if target is not None else
                                   [Upstream(target_kind, a, stub_class, transport == "lane") for a in addresses])
        self.watcher: UpstreamWatcher | None = None
        """Told when a replica stops answering (set by the backend that watches them)."""
        self.inflight: dict[str, Upstream] = {}
        """Request id -> the replica running it (where an abort goes)."""
        self.legs: dict[str, str] = {}
        """Request id -> the id it runs under on that replica (they differ after a failover)."""

    async def stream(self, request: worker_pb2.GenerateRequest) -> AsyncGenerator[Any, None]:
        """The request's GenerateResponse messages; closing the generator early cancels the call (the target
        then aborts the request and frees its KV)."""
        rid = request.request_id

        def on_target(target: Upstream, leg_id: str) -> None:
            self.inflight[rid] = target
            self.legs[rid] = leg_id

        can_fail_over = self.target_kind == "router" and len(self.group.upstreams) > 1
        relayed = failover.relay(request, self._open, self._read, on_target, can_fail_over)
        try:
            async for msg in relayed:
                yield msg
        finally:
            self.inflight.pop(rid, None)
            self.legs.pop(rid, None)
            await relayed.aclose()  # cancels the call (no-op once finished)

    async def _open(self, request: worker_pb2.GenerateRequest) -> tuple[Upstream, Any, Any, str]:
        """Start Generate on a ready target and wait for its first message; (target, call, first message or EOF,
        the request id it runs under). A replica that is unavailable before that is skipped for the next one
        (nothing was streamed yet), which gets the request under an id of its own: the first replica's worker
        may not have heard yet that it is gone. Other errors are the request's."""
        tried: list[str] = []
        last_error: RadixMeshError | None = None
        while True:
            targets = [t for t in self.group.ready() if t.address not in tried]
            if not targets:
                reason = self.not_ready_reason()
                raise last_error if last_error is not None and not reason else not_ready_error(reason)
            target = targets[0]
            attempt = failover.retry_request(request, len(tried))
            call = await self._start_call(target, attempt)
            try:
                return target, call, await call.read(), attempt.request_id  # EOF: ended OK without a message
            except (grpc.RpcError, RadixMeshError) as exc:
                call.cancel()
                error, gone, _ = self._failure(target, exc)
                if gone or error.code is ErrorCode.DRAINING:  # the next ready replica, or 503
                    self._mark_down(target, error)
                elif error.code is not ErrorCode.UNAVAILABLE or len(self.group.upstreams) == 1:
                    raise error from None
                logger.info("gateway: %s failed before streaming (%s); trying another", target.description, error)
                tried.append(target.address)
                last_error = error

    async def _start_call(self, target: Upstream, request: worker_pb2.GenerateRequest) -> Any:
        """Generate on the target's lane when it has one that answers, else over gRPC."""
        stream = None if target.lane is None else await target.lane.open(
            "Generate", request, worker_pb2.GenerateResponse, f"/{self._service_name}/Generate")
        return LaneCall(stream) if stream is not None else target.stub.Generate(request)

    def _failure(self, target: Upstream, exc: Exception) -> tuple[RadixMeshError, bool, bool]:
        """(the error, the target is unreachable, the error is the target's own) of a failed Generate."""
        if isinstance(exc, grpc.RpcError):
            return from_rpc_error(exc, f"{self.target_kind} at {target.address}"), unreachable(exc), \
                carries_error(exc)
        assert isinstance(exc, RadixMeshError)
        return exc, isinstance(exc, LaneBroken), not isinstance(exc, LaneBroken)

    async def _read(self, target: Upstream, call: Any) -> Any:
        try:
            return await call.read()
        except (grpc.RpcError, RadixMeshError) as exc:
            error, gone, carried = self._failure(target, exc)
            if carried:  # the target's own error (the worker failed the request, the router drained): as it is
                if error.code is ErrorCode.DRAINING:
                    self._mark_down(target, error)
                raise error from None
            if gone:
                self._mark_down(target, error)
            raise failover.StreamBroke(f"the stream from {target.description} broke after it started: "
                                       f"{error.message}") from None

    def _mark_down(self, target: Upstream, error: RadixMeshError) -> None:
        if self.watcher is not None:
            self.watcher.mark_down(self.group, target, error.message)

    async def abort(self, rid: str) -> None:
        target = self.inflight.get(rid)
        targets = [target] if target is not None else self.group.ready()
        leg_id = self.legs.get(rid, rid)
        for t in targets:  # an abort of an unknown or finished request is not an error
            with contextlib.suppress(Exception):
                await t.stub.Abort(worker_pb2.AbortRequest(request_id=leg_id), timeout=CONTROL_TIMEOUT_S)

    # ---- control ----------------------------------------------------------------------------------
    def control_target(self) -> Upstream:
        ready = self.group.ready()
        if not ready:
            raise not_ready_error(self.not_ready_reason())
        return ready[0]

    async def flush_cache(self) -> bool:
        target = self.control_target()
        response = await call_control(target.stub.FlushCache, worker_pb2.FlushCacheRequest(), target.address)
        return bool(response.flushed)

    async def load(self) -> WorkerLoad:
        return load_from_proto((await self._get_load()).load)

    async def server_info(self) -> dict[str, Any]:
        """The load in the stats dict shape, and a worker's KV transfers (its --kv-transport, transfers by
        transport; a router reports its workers' together)."""
        response = await self._get_load()
        info = load_from_proto(response.load).as_stats()
        if response.disagg.kv_transport:
            info.update(disagg_stats_from_proto(response.disagg))
        return info

    async def lora_call(self, method: str, request: Any) -> Any:
        """A LoRA control call (LoadLoraAdapter, UnloadLoraAdapter, ListLoraAdapters) on the first ready target: a
        router spreads it over its workers (radixmesh.router.lora_control), a worker answers for itself."""
        target = self.control_target()
        return await call_control(getattr(target.stub, method), request, target.address, LORA_TIMEOUT_S)

    async def _get_load(self) -> worker_pb2.GetLoadResponse:
        target = self.control_target()
        response: worker_pb2.GetLoadResponse = await call_control(target.stub.GetLoad, worker_pb2.GetLoadRequest(),
                                                                  target.address)
        return response


async def call_control(method: Callable[..., Any], request: Any, peer: str, timeout_s: float = CONTROL_TIMEOUT_S,
                       **kwargs: Any) -> Any:
    """A unary control call with the control timeout; a failure as the domain error naming `peer`."""
    try:
        return await method(request, timeout=timeout_s, **kwargs)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, peer) from None


class LaneCall:
    """A lane stream read as the gRPC call it replaces: `read` gives grpc.aio.EOF at the end."""

    def __init__(self, stream: LaneStream[worker_pb2.GenerateResponse]) -> None:
        self.stream = stream

    async def read(self) -> Any:
        msg = await self.stream.read()
        return grpc.aio.EOF if msg is None else msg

    def cancel(self) -> None:
        self.stream.cancel()


def unreachable(exc: grpc.RpcError) -> bool:
    """The call failed in transport (the peer is gone or not listening), not with a service's own error."""
    code = exc.code() if hasattr(exc, "code") else None
    return code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not carries_error(exc)


def carries_error(exc: grpc.RpcError) -> bool:
    """The status came from a radixmesh service's own error (with its detail trailer), not from the transport."""
    metadata = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return any(key == ERROR_METADATA_KEY for key, _ in (metadata or ()))
