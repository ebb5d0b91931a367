"""RouterService: Generate routed to a worker (with retries before the first token and migration after it, see
radixmesh.router.migration), plus the fan-out control RPCs."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc.aio

from radixmesh.common.drain import StreamDrain
from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.common.grpc_errors import map_errors
from radixmesh.protocol import common_pb2, router_pb2, router_pb2_grpc, worker_pb2
from radixmesh.router import metrics
from radixmesh.router.dispatch import RequestRouter
from radixmesh.router.lora_control import LoraControl
from radixmesh.router.migration import StreamProgress
from radixmesh.router.policies.base import RouteRequest, RoutingDecision
from radixmesh.router.workers import WorkerHandle
from radixmesh.wire.block_hash import block_hashes
from radixmesh.wire.convert import ROLE_TO_PROTO
from radixmesh.wire.load import load_to_proto, sum_loads
from radixmesh.wire.lora import adapter_extra_key

logger = logging.getLogger(__name__)
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name
MODEL_INFO_WAIT_S = 30.0


def route_request(request: worker_pb2.GenerateRequest, block_size: int) -> RouteRequest:
    """What the policy sees; the request's own block hashes when their block size matches ours."""
    hashes = list(request.block_hashes.hashes)
    if (request.block_hashes.block_size or 16) != block_size or (not hashes and len(request.token_ids) >= block_size):
        # ids from a client that did not hash them
        hashes = block_hashes(request.token_ids, block_size, adapter_extra_key(request.lora_name or None))
    return RouteRequest(request.request_id, len(request.token_ids), tuple(hashes), block_size, request.lora_name)


def routing_info(decision: RoutingDecision, attempt: int) -> common_pb2.RoutingInfo:
    info = common_pb2.RoutingInfo(worker_id=decision.worker.worker_id, worker_address=decision.worker.address,
                                  policy=decision.policy, attempt=attempt)
    for worker_id, score in sorted(decision.scores.items()):
        info.candidates.add(worker_id=worker_id, score=score,
                            cached_prefix_tokens=decision.cached_tokens.get(worker_id, 0))
    info.pd_reason = decision.pd_reason
    if decision.prefill is not None:
        prefill = decision.prefill.worker
        info.prefill_worker_id, info.prefill_worker_address = prefill.worker_id, prefill.address
        info.prefill_cached_prefix_tokens = decision.prefill.cached_tokens.get(prefill.worker_id, 0)
    return info


def name_peer(request: worker_pb2.GenerateRequest, decision: RoutingDecision) -> None:
    """Tell the chosen worker which peer holds a longer prefix of the prompt (clears it for other decisions)."""
    if decision.peer is None:
        request.ClearField("peer_prefix")
        return
    peer = decision.peer
    request.peer_prefix.CopyFrom(worker_pb2.PeerPrefix(worker_id=peer.worker.index_id or peer.worker.worker_id,
                                                       address=peer.worker.address, num_tokens=peer.num_tokens,
                                                       epoch=peer.epoch))


def name_prefill_worker(request: worker_pb2.GenerateRequest, decision: RoutingDecision) -> None:
    """Tell the decode worker which prefill worker computes the prompt (clears it for other decisions)."""
    if decision.prefill is None:
        request.ClearField("prefill")
        return
    prefill = decision.prefill.worker
    request.prefill.CopyFrom(worker_pb2.PrefillTarget(worker_id=prefill.worker_id, address=prefill.address))


class _RoutedCall:
    """What one Generate call learns while it is routed: the decision to report and timings."""

    def __init__(self, policy: str) -> None:
        self.decision: RoutingDecision | None = None
        self.attempt = 0
        self.worker_call_s = 0.0
        self.policy = policy
        """The policy that decided (the fallback's id while the index is down)."""

    def on_decision(self, decision: RoutingDecision, attempt: int) -> None:
        self.decision, self.attempt, self.policy = decision, attempt, decision.policy
        metrics.DECISIONS.labels(decision.policy, decision.reason, decision.worker.worker_id).inc()
        if attempt > 1:
            metrics.RETRIES.inc()


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, router: RequestRouter) -> None:
        self.router = router
        self.registry = router.registry
        self.lane_port = 0
        """The port of this router's Generate lane, reported by GetLoad (set once the server runs; 0: none)."""
        self.legs: dict[str, str] = {}
        """Request id -> the id its current leg runs under on its worker (they differ after a migration)."""
        self.drain = StreamDrain("router")
        """SIGTERM: new calls end DRAINING, routed streams finish or are cut (radixmesh.common.drain)."""
        self.lora = LoraControl(router.registry, router.adapters)
        """LoRA adapters loaded and unloaded across the workers (lora_control.py)."""
        for outcome in metrics.OUTCOMES:  # the series exist before the first request
            metrics.REQUESTS.labels(router.policy.policy_id, outcome)

    @map_errors("router")
    async def Generate(self, request: worker_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.GenerateResponse]:
        received = time.perf_counter()
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        self.drain.refuse_new()
        call = _RoutedCall(self.router.policy.active_policy())
        progress = StreamProgress(request)

        async def open_stream(worker: WorkerHandle, decision: RoutingDecision,
                              attempt: int) -> AsyncIterator[worker_pb2.GenerateResponse]:
            call.worker_call_s = time.perf_counter()
            leg = progress.next_request()
            if not leg.resume_output_ids:
                name_prefill_worker(leg, decision)
                name_peer(leg, decision)
            self.legs[request.request_id] = leg.request_id
            async for msg in worker.client.generate(leg):
                yield msg

        stream = self.router.stream(route_request(request, self.router.config.block_size), open_stream,
                                    call.on_decision, progress.can_resume)
        outcome = "cancelled"  # the caller left before the end
        try:
            async for msg in stream:
                if msg.finish_reason == common_pb2.FINISH_REASON_ABORT and self.drain.was_cut(request.request_id):
                    if msg.token_ids:  # the tokens the worker sent with its abort, then the call ends DRAINING
                        msg.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
                        yield progress.observe(msg)
                    raise self.drain.cut_error()
                progress.observe(msg)
                if call.decision is not None:
                    arrived = time.perf_counter()
                    msg.routing.CopyFrom(routing_info(call.decision, call.attempt))
                    call.decision = None
                    metrics.OVERHEAD.observe(call.worker_call_s - received + time.perf_counter() - arrived)
                yield msg
            outcome = "ok"
        except RadixMeshError as exc:
            outcome = "error"
            metrics.FAILURES.labels(exc.code.value).inc()
            raise
        finally:
            metrics.REQUESTS.labels(call.policy, outcome).inc()
            self.legs.pop(request.request_id, None)
            await stream.aclose()

    @map_errors("router")
    async def Abort(self, request: worker_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.AbortResponse:
        return worker_pb2.AbortResponse(found=await self._abort(request.request_id))

    async def _abort(self, request_id: str) -> bool:
        """Abort a routed request where its current leg runs; False when it runs nowhere."""
        worker = self.router.inflight.get(request_id)
        if worker is None:
            return False
        return bool(await worker.client.abort(self.legs.get(request_id, request_id)))

    async def drain_streams(self, timeout_s: float) -> int:
        """On SIGTERM: refuse new calls, let routed streams finish within `timeout_s`, then cut the rest
        (aborted on their workers; the callers continue them through another router replica)."""
        return await self.drain.run(lambda: self.router.inflight, self._abort, timeout_s)

    @map_errors("router")
    async def GetLoad(self, request: worker_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.GetLoadResponse:
        healthy = [w for w in self.registry.all() if w.health.healthy]
        return worker_pb2.GetLoadResponse(load=load_to_proto(sum_loads([w.load for w in healthy])),
                                          lane_port=self.lane_port, disagg=sum_transfers(healthy),
                                          draining=self.drain.draining)

    @map_errors("router")
    async def FlushCache(self, request: worker_pb2.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> worker_pb2.FlushCacheResponse:
        workers = [w for w in self.registry.all() if w.health.healthy]
        if not workers:
            raise RadixMeshError(ErrorCode.UNAVAILABLE, "no healthy worker to flush")
        results = await asyncio.gather(*(w.client.flush_cache() for w in workers))
        return worker_pb2.FlushCacheResponse(flushed=all(results))

    @map_errors("router")
    async def LoadLoraAdapter(self, request: common_pb2.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext) -> common_pb2.LoadLoraAdapterResponse:
        return await self.lora.load(request)

    @map_errors("router")
    async def UnloadLoraAdapter(self, request: common_pb2.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> common_pb2.UnloadLoraAdapterResponse:
        return await self.lora.unload(request)

    @map_errors("router")
    async def ListLoraAdapters(self, request: common_pb2.ListLoraAdaptersRequest,
                               context: grpc.aio.ServicerContext) -> common_pb2.ListLoraAdaptersResponse:
        return await self.lora.list()

    @map_errors("router")
    async def GetModelInfo(self, request: worker_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> worker_pb2.GetModelInfoResponse:
        deadline = time.monotonic() + MODEL_INFO_WAIT_S
        while True:  # at startup the workers may still be loading: wait a while for one
            healthy = [w for w in self.registry.all() if w.health.healthy]
            if healthy:
                info = await healthy[0].client.get_model_info()
                info.worker_id, info.role = "", common_pb2.WORKER_ROLE_UNSPECIFIED
                return info
            if time.monotonic() > deadline:
                raise RadixMeshError(ErrorCode.UNAVAILABLE, f"no healthy worker ({len(self.registry)} known)")
            await asyncio.sleep(0.2)

    @map_errors("router")
    async def ListWorkers(self, request: router_pb2.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> router_pb2.ListWorkersResponse:
        reply = router_pb2.ListWorkersResponse(policy=self.router.policy.active_policy())
        for w in self.registry.all():
            reply.workers.add(worker_id=w.worker_id, address=w.address, role=ROLE_TO_PROTO[w.role],
                              healthy=w.health.healthy, circuit_state=w.circuit_state.value,
                              num_inflight=w.num_inflight, load=load_to_proto(w.load))
        return reply


def sum_transfers(workers: list[WorkerHandle]) -> worker_pb2.DisaggStats:
    """The workers' KV transfers by transport (each counted once: received on its decode side, sent on its prefill
    side) and their --kv-transport values ("auto", or e.g. "auto,nixl" when they differ)."""
    total = worker_pb2.DisaggStats()
    modes = sorted({w.transfers.kv_transport for w in workers if w.transfers is not None and w.transfers.kv_transport})
    total.kv_transport = ",".join(modes)
    for w in workers:
        if w.transfers is None:
            continue
        for field in ("transfers_received_by_transport", "transfers_sent_by_transport"):
            for transport, count in getattr(w.transfers, field).items():
                getattr(total, field)[transport] += count
    return total

