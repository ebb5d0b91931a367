"""WorkerService.Prefill on a prefill worker: compute a prompt for a decode worker and send its KV.

    <- start: the prompt, start_pos, the transport
    compute the prompt as a one-token request (reusing this worker's radix cache), export the KV
    of positions start_pos.. through the transport:
    -> KV chunks ... -> the first token
    <- release (or the call ends, or the lease runs out): unlock the exported KV (it stays cached)

Cancelling the call before the result aborts the prefill; an Abort of the request id here ends
the call with an ABORT result, which aborts the sequence on the decode worker too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

from radixmesh.common import aio
from radixmesh.common.errors import invalid_argument
from radixmesh.engine.client import EngineClient
from radixmesh.engine.disagg.client import DisaggClient
from radixmesh.protocol import worker_pb2
from radixmesh.wire.convert import kv_chunk_to_proto, prefill_result_to_proto, sampling_from_proto
from radixmesh.wire.disagg import KVExportMsg, PrefillReqMsg
from radixmesh.wire.messages import TokenOut
from radixmesh.worker.config import WorkerConfig
from radixmesh.worker.load import LoadTracker
from radixmesh.worker.timeline import RequestTimeline, record_kv_transfer

logger = logging.getLogger(__name__)


class PrefillFlow:
    """The prefill side of disaggregation in a worker front end (one per worker)."""

    def __init__(self, engine: EngineClient, config: WorkerConfig, load: LoadTracker) -> None:
        self.engine = engine
        self.disagg = DisaggClient(engine)
        self.config = config
        self.load = load

    async def serve(self, requests: AsyncIterator[worker_pb2.PrefillRequest],
                    ) -> AsyncGenerator[worker_pb2.PrefillResponse, None]:
        """One Prefill call (see the module docstring); errors are RadixMeshError for the servicer to map."""
        first = await anext(requests, None)
        if first is None or not first.HasField("start"):
            raise invalid_argument("a Prefill call starts with PrefillRequest.start", "start")
        msg = self._prefill_msg(first.start)
        last: TokenOut | None = None
        num_bytes, transport = 0, msg.transport
        async with contextlib.aclosing(self._run(msg, first.start.decode_worker_id)) as items:
            async for item in items:
                if isinstance(item, KVExportMsg):
                    num_bytes += item.chunk.num_bytes
                    transport = item.chunk.transport  # what auto chose
                    yield worker_pb2.PrefillResponse(kv_chunk=kv_chunk_to_proto(item))
                else:
                    last = item
        assert last is not None and last.finish_reason is not None, "the prefill stream ended early"
        result = worker_pb2.PrefillResponse(result=prefill_result_to_proto(last, num_bytes, self.config.worker_id))
        if last.finish_reason == "abort":  # nothing stays exported
            yield result
            return
        sent_at = time.time()
        try:  # the KV is held from here: a call closed at the result's yield (the decode worker gone) releases it
            yield result
            await wait_release(requests, msg.lease_s)
        finally:
            await self.disagg.release(msg.transfer_id)
            record_kv_transfer(transport, "send", num_bytes, sent_at, time.time(),
                               attributes={"radixmesh.request_id": msg.rid,
                                           "kv.decode_worker_id": first.start.decode_worker_id,
                                           "kv.tokens": len(msg.input_ids) - msg.start_pos})

    def _prefill_msg(self, start: worker_pb2.PrefillStart) -> PrefillReqMsg:
        ids, params = list(start.token_ids), sampling_from_proto(start.sampling_params)
        transport = self.config.serving_transport(start.kv_transport)
        if params.n != 1:
            raise invalid_argument("a Prefill call is one sequence: n must be 1", "n")
        self.engine.validate(ids, params)
        if start.start_pos >= len(ids):
            raise invalid_argument(f"start_pos {start.start_pos} must be below the prompt's {len(ids)} tokens",
                                   "start_pos")
        if start.request_id in self.load.active:
            raise invalid_argument(f"request id {start.request_id!r} is already running on this worker", "request_id")
        lease_s = min(start.lease_ms / 1000, self.config.kv_lease_s) if start.lease_ms else self.config.kv_lease_s
        return PrefillReqMsg(start.request_id or uuid.uuid4().hex, uuid.uuid4().hex, ids, params, start.start_pos,
                             transport, lease_s, bytes(start.transport_params))

    async def _run(self, msg: PrefillReqMsg, decode_worker_id: str) -> AsyncGenerator[KVExportMsg | TokenOut, None]:
        """The scheduler's answers, tracked as this worker's load and timed as its queue/prefill spans."""
        timeline = RequestTimeline(msg.rid, len(msg.input_ids), {
            "radixmesh.worker_id": self.config.worker_id, "radixmesh.role": self.config.role,
            "radixmesh.decode_worker_id": decode_worker_id})
        try:
            with self.load.track(msg.rid, len(msg.input_ids)) as seq:
                async with contextlib.aclosing(self.disagg.prefill(msg)) as items:
                    async for item in items:
                        if isinstance(item, TokenOut):
                            timeline.on_output(item)
                            self.load.update(seq, len(item.token_ids))
                        yield item
        finally:
            timeline.close()


async def wait_release(requests: AsyncIterator[worker_pb2.PrefillRequest | worker_pb2.FetchKVRequest],
                       lease_s: float) -> None:
    """Until the peer (a decode worker, or a worker fetching a prefix) releases the KV, ends its side of the
    call, or the lease runs out."""
    try:
        message = await aio.wait_for(anext(requests, None), lease_s)
    except asyncio.TimeoutError:
        logger.warning("no release within the %.0f s lease; releasing the exported KV", lease_s)
        return
    if message is not None and message.HasField("release") and not message.release.committed:
        logger.info("the decode worker gave the transfer up")
