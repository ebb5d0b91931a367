"""A worker's lease as stored in Redis: a serialized `radixmesh.v1.WorkerLease` under a key with a TTL.

Parsed defensively: a lease that does not decode or lacks an address is ignored and logged.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from radixmesh.protocol import common_pb2, kv_index_pb2

logger = logging.getLogger(__name__)

_ROLES = {"unified": common_pb2.WORKER_ROLE_UNIFIED, "prefill": common_pb2.WORKER_ROLE_PREFILL,
          "decode": common_pb2.WORKER_ROLE_DECODE}
_ROLE_NAMES = {value: name for name, value in _ROLES.items()}


@dataclass(frozen=True)
class WorkerLease:
    """A live worker as its lease describes it."""

    worker_id: str
    """The id the worker publishes its blocks under."""
    epoch: int
    """Generation of the worker's entries; only entries of this epoch count."""
    address: str
    """host:port others dial for its gRPC service."""
    role: str = "unified"
    """unified | prefill | decode."""
    block_size: int = 16
    """Tokens per block the worker hashes with."""
    metrics_port: int = 0
    """Prometheus port (0: none)."""
    started_ms: int = 0
    """Unix time the writer started, in ms."""
    lora_adapters: tuple[str, ...] = ()
    """LoRA adapters the worker holds, sorted (a load or unload rewrites the lease at once)."""
    max_loras_per_batch: int = 0
    """Adapters one of its batches may mix (0: it serves no adapters)."""

    def to_bytes(self) -> bytes:
        msg = kv_index_pb2.WorkerLease(worker_id=self.worker_id, address=self.address, role=_ROLES[self.role],
                                       epoch=self.epoch, block_size=self.block_size, metrics_port=self.metrics_port,
                                       started_ms=self.started_ms, heartbeat_ms=int(time.time() * 1000),
                                       lora_adapters=list(self.lora_adapters),
                                       max_loras_per_batch=self.max_loras_per_batch)
        return msg.SerializeToString()


def parse_lease(worker_id: str, raw: bytes | str | None) -> WorkerLease | None:
    """The lease stored for `worker_id`, or None when there is none (None) or it is malformed (logged)."""
    if raw is None:
        return None
    data = raw.encode() if isinstance(raw, str) else raw
    try:
        msg = kv_index_pb2.WorkerLease.FromString(data)
    except DecodeError:
        logger.warning("index: ignoring undecodable lease of worker %r (%d bytes)", worker_id, len(data))
        return None
    if msg.worker_id != worker_id or ":" not in msg.address or msg.epoch < 1 or msg.role not in _ROLE_NAMES:
        logger.warning("index: ignoring malformed lease of worker %r: id=%r address=%r epoch=%d role=%d",
                       worker_id, msg.worker_id, msg.address, msg.epoch, msg.role)
        return None
    return WorkerLease(worker_id=worker_id, epoch=msg.epoch, address=msg.address, role=_ROLE_NAMES[msg.role],
                       block_size=msg.block_size, metrics_port=msg.metrics_port, started_ms=msg.started_ms,
                       lora_adapters=tuple(msg.lora_adapters), max_loras_per_batch=msg.max_loras_per_batch)
