"""Generate on a decode worker whose router named a prefill worker (GenerateRequest.prefill).

    reserve KV here for the uncached suffix --> Prefill call to the prefill worker:
        start ->  <- KV chunks (landed in the reserved slots as they come)  <- first token
    --> transfer_done (every layer in the pool) --> release -> --> commit, decode here

Whatever goes wrong before the commit (the reservation is refused, the prefill worker is
unreachable, dies, answers an error or takes longer than `prefill_timeout_s`, a chunk does not
fit) ends in a fallback: the reservation's slots are freed and the prompt is computed here, so
the sequence is never lost. An abort here cancels the Prefill call (the prefill worker aborts
too); an abort on the prefill worker ends the call with an ABORT result and the sequence here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc
import grpc.aio

from radixmesh.common import aio
from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.common.grpc_errors import from_rpc_error
from radixmesh.engine.client import EngineClient
from radixmesh.engine.disagg.client import DisaggClient, Grant
from radixmesh.protocol import common_pb2, worker_pb2
from radixmesh.wire.convert import kv_chunk_from_proto, sampling_to_proto
from radixmesh.wire.disagg import ResolveReservationMsg
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.sampling import SamplingParams
from radixmesh.worker import metrics
from radixmesh.worker.config import WorkerConfig
from radixmesh.worker.prefill_peers import PrefillPeers
from radixmesh.worker.timeline import record_kv_transfer, record_kv_transfer_span

logger = logging.getLogger(__name__)
RELEASE_DRAIN_S = 10.0
"""How long a released Prefill call may take to end before it is cancelled."""


def local_only_reason(params: SamplingParams) -> str | None:
    """Why a sequence must be prefilled here even with a prefill worker named (None: it need not)."""
    if params.logprob_start_len >= 0:
        return "prompt log-probs"  # the prefill worker samples one token and scores no prompt
    if params.has_grammar:
        return "a grammar"  # the matcher must see every token of this sequence here
    return None


@dataclass
class _Exchange:
    """One Prefill call as the decode side sees it."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    target: worker_pb2.PrefillTarget
    grant: Grant
    first_chunk_at: float | None = None
    result: worker_pb2.PrefillResult | None = None
    num_bytes: int = 0
    transport: str = ""
    """The transport the KV came with (the first chunk's)."""


class DecodeFlow:
    """The decode side of disaggregation in a worker front end (one per worker)."""

    def __init__(self, engine: EngineClient, config: WorkerConfig, peers: PrefillPeers | None = None) -> None:
        self.engine = engine
        self.disagg = DisaggClient(engine)
        self.config = config
        self.peers = peers or PrefillPeers()
        self._pending: set[str] = set()
        """Sequences before their commit (reserving, or waiting for the prefill worker)."""
        self._exchanges: dict[str, asyncio.Task[None]] = {}
        self._aborted: set[str] = set()
        self._draining: set[asyncio.Task[None]] = set()
        self._transports: dict[str, str] = {}
        """Prefill worker id -> the transport its last transfer came with."""

    def abort(self, rid: str) -> bool:
        """Stop a sequence that is not committed yet (its Prefill call is cancelled); False when it is not
        at that stage (then the scheduler's own abort stops it)."""
        if rid not in self._pending:
            return False
        self._aborted.add(rid)
        exchange = self._exchanges.get(rid)
        if exchange is not None:
            exchange.cancel()
        return True

    async def generate(self, rid: str, input_ids: list[int], params: SamplingParams,
                       target: worker_pb2.PrefillTarget) -> AsyncGenerator[TokenOut, None]:
        """The sequence's tokens, as `EngineClient.generate_tokens` streams them; leaving early aborts it."""
        self.engine.validate(input_ids, params)
        reason = local_only_reason(params)
        if reason is not None:
            logger.debug("request %s: prefilled here despite prefill worker %s (%s)", rid, target.worker_id, reason)
            stream = self.engine.generate_tokens(input_ids, params, rid)
        else:
            resolve = await self._prefill_remotely(rid, input_ids, params, target)
            if resolve is None:
                yield TokenOut(rid, [], len(input_ids), 0, 0, finish_reason="abort")
                return
            stream = self.disagg.resolve(resolve)  # sent before any other task runs: an abort comes after it
        async with contextlib.aclosing(stream) as outs:
            async for out in outs:
                yield out

    async def close(self) -> None:
        for task in list(self._draining):
            task.cancel()
        await self.peers.close()

    # ---- before the commit ------------------------------------------------------------------------
    async def _prefill_remotely(self, rid: str, input_ids: list[int], params: SamplingParams,
                                target: worker_pb2.PrefillTarget) -> ResolveReservationMsg | None:
        """Reserve and run the Prefill call; returns how to resolve the reservation (None: aborted)."""
        self._pending.add(rid)
        try:
            grant = await self._reserve(rid, input_ids, params)
            if rid in self._aborted:
                if grant is not None:
                    await self.disagg.cancel(grant.reservation_id)
                return None
            if grant is None:
                return _fallback(rid, "", input_ids, params, "reservation_refused")
            return await self._run_exchange(_Exchange(rid, input_ids, params, target, grant))
        finally:
            self._pending.discard(rid)
            self._aborted.discard(rid)

    async def _run_exchange(self, exchange: _Exchange) -> ResolveReservationMsg | None:
        """The Prefill call under the timeout, and what its outcome means for the reservation."""
        rid, reservation_id = exchange.rid, exchange.grant.reservation_id
        task = asyncio.create_task(self._exchange(exchange), name=f"prefill-{rid}")
        self._exchanges[rid] = task
        try:
            await asyncio.wait({task}, timeout=self.config.prefill_timeout_s)
            if not task.done():
                task.cancel()
                await asyncio.wait({task})  # its call is cancelled: the prefill worker aborts
                return self._on_failure(exchange, TimeoutError())
        except asyncio.CancelledError:  # the caller went away: the servicer aborts the sequence
            task.cancel()
            await self.disagg.cancel(reservation_id)
            raise
        finally:
            self._exchanges.pop(rid, None)
        if rid in self._aborted or task.cancelled():  # aborted here, or on the prefill worker (ABORT result)
            await self.disagg.cancel(reservation_id)
            return None
        error = task.exception()
        if isinstance(error, RadixMeshError):
            return self._on_failure(exchange, error)
        if error is not None:
            raise error
        return self._on_result(exchange)

    async def _reserve(self, rid: str, input_ids: list[int], params: SamplingParams) -> Grant | None:
        start = time.time()
        try:
            grant = await self.disagg.reserve(rid, input_ids, params, self.config.kv_lease_s)
        except RadixMeshError as exc:
            if exc.code is not ErrorCode.RESOURCE_EXHAUSTED:
                raise
            metrics.observe_reservation("refused", time.time() - start)
            logger.warning("request %s: %s; computing the prompt here", rid, exc.message)
            return None
        metrics.observe_reservation("granted", time.time() - start)
        record_kv_transfer_span("worker.kv_reserve", start, time.time(), self.config.kv_transport, 0,
                                attributes={"radixmesh.request_id": rid, "kv.prefix_len": grant.prefix_len,
                                            "kv.reserved_tokens": grant.num_reserved_tokens})
        return grant

    async def _exchange(self, ex: _Exchange) -> None:
        """The Prefill call: start, land every chunk, take the result, confirm the KV, release."""
        call = self.peers.stub(ex.target.address).Prefill()
        try:
            await call.write(worker_pb2.PrefillRequest(start=self._start_msg(ex)))
            while ex.result is None:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    raise RadixMeshError(ErrorCode.UNAVAILABLE, "the prefill worker ended the call without a result")
                if msg.HasField("kv_chunk"):
                    ex.first_chunk_at = ex.first_chunk_at or time.time()
                    self._note_transport(ex, msg.kv_chunk.transport)
                    await self.disagg.land(ex.grant.reservation_id, kv_chunk_from_proto(msg.kv_chunk))
                else:
                    ex.result = msg.result
            if ex.result.finish_reason == common_pb2.FINISH_REASON_ABORT:
                self._aborted.add(ex.rid)  # aborted on the prefill worker: abort here as well
                return
            ex.num_bytes = await self.disagg.transfer_done(ex.grant.reservation_id)
            self._release(call)
            call = None
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, peer=f"prefill worker {ex.target.worker_id} at {ex.target.address}") from None
        finally:
            if call is not None:
                call.cancel()

    def _start_msg(self, ex: _Exchange) -> worker_pb2.PrefillStart:
        return worker_pb2.PrefillStart(
            request_id=ex.rid, token_ids=ex.input_ids, sampling_params=sampling_to_proto(ex.params),
            start_pos=ex.grant.prefix_len, kv_transport=self.config.kv_transport,
            lease_ms=int(self.config.kv_lease_s * 1000), decode_worker_id=self.config.worker_id,
            transport_params=ex.grant.transport_params)

    def _note_transport(self, ex: _Exchange, transport: str) -> None:
        """Remember the transport of the exchange; log each prefill worker's first one (and a change)."""
        if ex.transport:
            return
        ex.transport = transport
        if self._transports.get(ex.target.worker_id) != transport:
            self._transports[ex.target.worker_id] = transport
            logger.info("KV from prefill worker %s at %s comes over %s (--kv-transport %s)", ex.target.worker_id,
                        ex.target.address, transport, self.config.kv_transport)

    def _release(self, call: grpc.aio.StreamStreamCall) -> None:
        """Tell the prefill worker the KV landed, off the request's path; it then ends the call."""
        async def release() -> None:
            try:
                await call.write(worker_pb2.PrefillRequest(release=worker_pb2.PrefillRelease(committed=True)))
                await call.done_writing()
                await aio.wait_for(call.read(), RELEASE_DRAIN_S)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
                pass  # the prefill worker releases by lease (or on the broken call) instead
            finally:
                call.cancel()

        task = asyncio.create_task(release())
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    # ---- outcomes ---------------------------------------------------------------------------------
    def _on_result(self, ex: _Exchange) -> ResolveReservationMsg:
        result = ex.result
        assert result is not None, "the exchange ended without a result"
        now = time.time()
        record_kv_transfer(ex.transport or self.config.kv_transport, "receive", ex.num_bytes, ex.first_chunk_at or now,
                           now, attributes={"radixmesh.request_id": ex.rid, "kv.prefill_worker_id": ex.target.worker_id,
                                            "kv.tokens": ex.grant.num_reserved_tokens})
        top = [(e.token_id, e.logprob) for e in result.top_logprobs.entries] or None
        return ResolveReservationMsg(ex.rid, ex.grant.reservation_id, ex.input_ids, ex.params,
                                     first_token=result.token_id,
                                     logprob=result.logprob if result.HasField("logprob") else None,
                                     top_logprobs=top, cached_tokens=result.cached_tokens)

    def _on_failure(self, ex: _Exchange, exc: RadixMeshError | TimeoutError) -> ResolveReservationMsg:
        if isinstance(exc, TimeoutError):
            reason, detail = "prefill_timeout", f"no KV within {self.config.prefill_timeout_s:g} s"
        elif ex.result is not None:
            reason, detail = "transfer_failed", exc.message
        elif exc.code is ErrorCode.UNAVAILABLE:
            reason, detail = "prefill_unavailable", exc.message
        else:
            reason, detail = "prefill_error", exc.message
        logger.warning("request %s: prefill worker %s failed (%s: %s); computing the prompt here",
                       ex.rid, ex.target.worker_id, reason, detail)
        return _fallback(ex.rid, ex.grant.reservation_id, ex.input_ids, ex.params, reason)


def _fallback(rid: str, reservation_id: str, input_ids: list[int], params: SamplingParams,
              reason: str) -> ResolveReservationMsg:
    """Resolve by computing the prompt here (frees the reservation's slots, if there is one)."""
    metrics.observe_kv_transfer_fallback(reason)
    return ResolveReservationMsg(rid, reservation_id, input_ids, params, fallback_reason=reason)
