"""WorkerService.FetchKV: send a peer the KV of a prompt prefix this worker has cached (prefix sharing).

    <- start: the prefix's token ids, start_pos, the transport, the epoch the router saw
    export what this worker's radix cache holds of positions start_pos.. on its device (nothing computed):
    -> KV chunks ... -> result (end_pos: where the sent KV ends)
    <- release (or the call ends, or the lease runs out): unlock the exported KV (it stays cached)

An epoch other than this worker's current index epoch means the router read entries of an earlier
life of this worker: the fetch is refused (ABORTED) and the peer computes the prompt itself.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from radixmesh.common.errors import ErrorCode, RadixMeshError, invalid_argument
from radixmesh.engine.client import EngineClient
from radixmesh.engine.disagg.client import DisaggClient
from radixmesh.engine.disagg.transport.registry import AUTO, check_transport_device
from radixmesh.protocol import worker_pb2
from radixmesh.wire.convert import kv_chunk_to_proto
from radixmesh.wire.disagg import ExportCachedReqMsg, KVExportMsg
from radixmesh.worker import tier_metrics
from radixmesh.worker.config import WorkerConfig
from radixmesh.worker.disagg_prefill import wait_release
from radixmesh.worker.timeline import record_kv_transfer_span


class PeerExportFlow:
    """The exporting side of prefix sharing in a worker front end (every role serves it)."""

    def __init__(self, engine: EngineClient, config: WorkerConfig, epoch: Callable[[], int]) -> None:
        self.engine = engine
        self.disagg = DisaggClient(engine)
        self.config = config
        self.epoch = epoch
        """This worker's current index epoch (0: it publishes no index)."""

    async def serve(self, requests: AsyncIterator[worker_pb2.FetchKVRequest],
                    ) -> AsyncGenerator[worker_pb2.FetchKVResponse, None]:
        first = await anext(requests, None)
        if first is None or not first.HasField("start"):
            raise invalid_argument("a FetchKV call starts with FetchKVRequest.start", "start")
        msg = self._export_msg(first.start)
        started, end, num_bytes, transport = time.time(), 0, 0, msg.transport
        async with contextlib.aclosing(self.engine.stream(msg)) as items:
            async for item in items:
                if isinstance(item, KVExportMsg):
                    num_bytes += item.chunk.num_bytes
                    transport = item.chunk.transport  # what auto chose
                    yield worker_pb2.FetchKVResponse(kv_chunk=kv_chunk_to_proto(item))
                else:
                    end = item.cached_tokens
        result = worker_pb2.FetchKVResponse(result=worker_pb2.FetchKVResult(
            end_pos=end, kv_bytes=num_bytes, worker_id=self.config.worker_id))
        tier_metrics.observe_peer_export(num_bytes)
        if end <= msg.start_pos:  # nothing exported
            yield result
            return
        try:  # the KV is held from here: a call closed at the result's yield (the peer gone) releases it
            yield result
            await wait_release(requests, msg.lease_s)
        finally:
            await self.disagg.release(msg.transfer_id)
            record_kv_transfer_span("worker.kv_export_cached", started, time.time(), transport, num_bytes,
                                    attributes={"radixmesh.request_id": first.start.request_id,
                                                "kv.requester_worker_id": first.start.requester_worker_id,
                                                "kv.tokens": end - msg.start_pos})

    def _export_msg(self, start: worker_pb2.FetchKVStart) -> ExportCachedReqMsg:
        ids = list(start.token_ids)
        if not ids or start.start_pos >= len(ids):
            raise invalid_argument(f"start_pos {start.start_pos} must be below the prefix's {len(ids)} tokens",
                                   "start_pos")
        vocab = self.engine.model_config.vocab_size
        if max(ids) >= vocab:
            raise invalid_argument(f"token id {max(ids)} is outside the vocabulary of {vocab}", "token_ids")
        current = self.epoch()
        if start.epoch and current and start.epoch != current:
            raise RadixMeshError(ErrorCode.ABORTED, f"this worker's cache is of epoch {current}, not {start.epoch}: "
                                                    "the index entry the router read is stale")
        transport = start.kv_transport if start.kv_transport not in ("", AUTO) else self.config.kv_transport
        check_transport_device(transport, self.engine.config.device)
        lease_s = min(start.lease_ms / 1000, self.config.kv_lease_s) if start.lease_ms else self.config.kv_lease_s
        rid = f"{start.request_id or 'fetch'}/export-{uuid.uuid4().hex[:12]}"
        return ExportCachedReqMsg(rid, uuid.uuid4().hex, ids, start.start_pos, transport, lease_s,
                                  bytes(start.transport_params))
