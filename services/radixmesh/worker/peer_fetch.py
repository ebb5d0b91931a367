"""Generate with a prefix a router says a peer holds (GenerateRequest.peer_prefix): fetch its KV, serve here.

    how much do I hold? is fetching the rest cheaper than computing it (fetch_cost)? if so:
    reserve KV here for the part I lack --> FetchKV call to the peer:
        start ->  <- KV chunks (landed in the reserved slots as they come)  <- result (where its KV ends)
    --> transfer_done (every layer in the pool) --> release (off the request's path)
    --> commit: the prefix into the radix cache, the request queued (it matches the prefix at admission)

Whatever goes wrong before the commit (no slots, the peer is unreachable, dies, restarted since the
index was read, holds nothing, or is slower than `peer_fetch_timeout_s`) ends in a fallback: the
reservation is freed and the prompt is computed here. The request is never lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc
import grpc.aio

from radixmesh.common import aio
from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.common.grpc_errors import from_rpc_error
from radixmesh.engine.client import EngineClient
from radixmesh.engine.disagg.client import DisaggClient, Grant
from radixmesh.protocol import worker_pb2
from radixmesh.wire.convert import kv_chunk_from_proto
from radixmesh.wire.disagg import CommitFetchMsg, PrefixLenReqMsg, TrimReservationMsg
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.sampling import SamplingParams
from radixmesh.worker import tier_metrics
from radixmesh.worker.config import WorkerConfig
from radixmesh.worker.disagg_decode import RELEASE_DRAIN_S
from radixmesh.worker.fetch_cost import FetchCostModel
from radixmesh.worker.prefill_peers import PrefillPeers
from radixmesh.worker.timeline import record_kv_transfer_span

logger = logging.getLogger(__name__)


@dataclass
class _Fetch:
    """One fetch as the fetching side sees it."""

    rid: str
    ids: list[int]
    params: SamplingParams
    peer: worker_pb2.PeerPrefix
    want: int
    """Prompt positions [0, want) are asked for."""
    grant: Grant | None = None
    end: int = 0
    """Where the peer's KV ends (0 until its result came)."""
    num_bytes: int = 0
    transport: str = ""
    """The transport the KV came with (its first chunk's)."""


KV_ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
"""Bytes of one K or V element by the engine's dtype or --kv-cache-dtype (the front end imports no torch)."""


def kv_bytes_per_token(engine: EngineClient) -> int:
    """Bytes of K plus V for one token across all layers, as the KV pool stores them."""
    mc, config = engine.model_config, engine.config
    dtype = config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * KV_ITEM_BYTES[dtype]


class PeerFetchFlow:
    """The fetching side of prefix sharing in a worker front end (unified and decode workers)."""

    def __init__(self, engine: EngineClient, config: WorkerConfig, peers: PrefillPeers | None = None) -> None:
        self.engine = engine
        self.disagg = DisaggClient(engine)
        self.config = config
        self.peers = peers or PrefillPeers()
        self.costs = FetchCostModel(engine.config.device, config.kv_transport, kv_bytes_per_token(engine))
        self._fetched: dict[str, int] = {}
        self._draining: set[asyncio.Task[None]] = set()

    def take_fetched(self, rid: str) -> int:
        """Prompt tokens fetched for `rid` (read once, for its first response)."""
        return self._fetched.pop(rid, 0)

    async def generate(self, rid: str, ids: list[int], params: SamplingParams,
                       peer: worker_pb2.PeerPrefix) -> AsyncGenerator[TokenOut, None]:
        """The sequence's tokens, as `EngineClient.generate_tokens` streams them; leaving early aborts it."""
        self.engine.validate(ids, params)
        commit = await self._try_fetch(rid, ids, params, peer)
        stream = self.engine.stream(commit) if commit is not None else self.engine.generate_tokens(ids, params, rid)
        try:
            async with contextlib.aclosing(stream) as outs:
                async for out in outs:
                    assert isinstance(out, TokenOut), "a committed fetch streams tokens only"
                    yield out
        finally:
            self._fetched.pop(rid, None)

    async def close(self) -> None:
        for task in list(self._draining):
            task.cancel()
        await self.peers.close()

    # ---- the decision -----------------------------------------------------------------------------
    async def _skip_reason(self, fetch: _Fetch) -> str | None:
        """Why the prefix is computed here without asking the peer (None: fetch it)."""
        peer, config = fetch.peer, self.config
        if peer.worker_id == config.worker_id or peer.address == config.advertise_address:
            return "peer_is_self"
        if fetch.params.logprob_start_len >= 0:
            return "prompt_logprobs"
        held = await self.engine.query(PrefixLenReqMsg(uuid.uuid4().hex, fetch.ids[: fetch.want]))
        gain = fetch.want - int(held["device_len"]) - int(held["host_len"])
        if gain < config.peer_fetch_min_tokens:
            return "cached_here"
        decision = self.costs.decide(gain)
        if config.peer_fetch == "auto" and not decision.fetch:
            logger.debug("request %s: computing %d tokens (%.1f ms) beats fetching them (%.1f ms)", fetch.rid, gain,
                         1000 * decision.compute_s, 1000 * decision.fetch_s)
            return "cheaper_to_compute"
        return None

    async def _try_fetch(self, rid: str, ids: list[int], params: SamplingParams,
                         peer: worker_pb2.PeerPrefix) -> CommitFetchMsg | None:
        """The commit of a fetch that ran (its fallback reason set when it failed); None when none ran."""
        fetch = _Fetch(rid, ids, params, peer, min(int(peer.num_tokens), len(ids) - 1))
        skip = await self._skip_reason(fetch)
        if skip is not None:
            logger.debug("request %s: not fetching from %s (%s)", rid, peer.worker_id, skip)
            tier_metrics.observe_peer_fetch("skipped")
            return None
        start = time.time()
        try:
            await aio.wait_for(self._fetch(fetch), self.config.peer_fetch_timeout_s)
            reason = "" if fetch.grant is None or fetch.end > fetch.grant.prefix_len else "peer_holds_nothing"
        except asyncio.TimeoutError:
            reason = "peer_timeout"
        except asyncio.CancelledError:  # the caller went away: free the reservation now, not at its lease
            if fetch.grant is not None:
                await self.disagg.cancel(fetch.grant.reservation_id)
            raise
        except RadixMeshError as exc:
            reason = {ErrorCode.UNAVAILABLE: "peer_unavailable", ErrorCode.ABORTED: "peer_stale",
                      ErrorCode.RESOURCE_EXHAUSTED: "reservation_refused"}.get(exc.code, "peer_error")
            logger.warning("request %s: fetching its prefix from %s failed (%s); computing it here", rid,
                           peer.worker_id, exc.message)
        elapsed = time.time() - start
        if reason in ("peer_timeout", "peer_holds_nothing"):  # the other reasons were logged with their error
            logger.warning("request %s: fetching its prefix from %s ended in %s after %.2f s; computing it here", rid,
                           peer.worker_id, reason, elapsed)
        self._record(fetch, reason, start, elapsed)
        if fetch.grant is None:
            return None  # no reservation was made: an ordinary request
        return CommitFetchMsg(rid, fetch.grant.reservation_id, ids, params, fallback_reason=reason)

    def _record(self, fetch: _Fetch, reason: str, start: float, elapsed: float) -> None:
        tokens = fetch.end - fetch.grant.prefix_len if fetch.grant is not None and not reason else 0
        if tokens:
            self._fetched[fetch.rid] = tokens
            self.costs.observe_fetch(fetch.num_bytes, elapsed)
        tier_metrics.observe_peer_fetch("fallback" if reason else "committed", elapsed, fetch.num_bytes, tokens)
        transport = fetch.transport or self.config.kv_transport
        record_kv_transfer_span("worker.peer_fetch", start, start + elapsed, transport,
                                fetch.num_bytes, attributes={"radixmesh.request_id": fetch.rid,
                                                             "kv.peer_worker_id": fetch.peer.worker_id,
                                                             "kv.tokens": tokens, "kv.fallback_reason": reason})

    # ---- the exchange -----------------------------------------------------------------------------
    async def _fetch(self, fetch: _Fetch) -> None:
        """Reserve, run the FetchKV call and land its chunks; raises RadixMeshError on any failure."""
        fetch.grant = await self.disagg.reserve(fetch.rid, fetch.ids[: fetch.want], fetch.params,
                                                self.config.kv_lease_s)
        call = self.peers.stub(fetch.peer.address).FetchKV()
        try:
            await call.write(worker_pb2.FetchKVRequest(start=self._start_msg(fetch, fetch.grant)))
            result = await self._land_chunks(call, fetch, fetch.grant)
            fetch.end = result.end_pos
            if fetch.end <= fetch.grant.prefix_len:
                return  # the peer holds nothing beyond what this worker has
            fetch.num_bytes = await self.disagg.transfer_done(fetch.grant.reservation_id)
            self._release(call)
            call = None
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, peer=f"peer worker {fetch.peer.worker_id} at {fetch.peer.address}") from None
        finally:
            if call is not None:
                call.cancel()

    async def _land_chunks(self, call: grpc.aio.StreamStreamCall, fetch: _Fetch,
                           grant: Grant) -> worker_pb2.FetchKVResult:
        trimmed = False
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                raise RadixMeshError(ErrorCode.UNAVAILABLE, "the peer ended the call without a result")
            if not msg.HasField("kv_chunk"):
                result: worker_pb2.FetchKVResult = msg.result
                return result
            chunk = kv_chunk_from_proto(msg.kv_chunk)
            fetch.transport = fetch.transport or chunk.transport
            if not trimmed and chunk.num_tokens < grant.num_reserved_tokens:  # the peer holds less than asked
                await self.engine.send(TrimReservationMsg(grant.reservation_id, chunk.num_tokens))
            trimmed = True
            await self.disagg.land(grant.reservation_id, chunk)

    def _start_msg(self, fetch: _Fetch, grant: Grant) -> worker_pb2.FetchKVStart:
        return worker_pb2.FetchKVStart(
            request_id=fetch.rid, token_ids=fetch.ids[: fetch.want], start_pos=grant.prefix_len,
            kv_transport=self.config.kv_transport, lease_ms=int(self.config.kv_lease_s * 1000),
            requester_worker_id=self.config.worker_id, epoch=fetch.peer.epoch, transport_params=grant.transport_params)

    def _release(self, call: grpc.aio.StreamStreamCall) -> None:
        """Tell the peer the KV landed, off the request's path; it then unlocks its copy and ends the call."""
        async def release() -> None:
            try:
                await call.write(worker_pb2.FetchKVRequest(release=worker_pb2.PrefillRelease(committed=True)))
                await call.done_writing()
                await aio.wait_for(call.read(), RELEASE_DRAIN_S)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
                pass  # the peer releases by lease (or on the broken call) instead
            finally:
                call.cancel()

        task = asyncio.create_task(release())
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)
