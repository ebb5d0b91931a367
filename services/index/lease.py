"""A worker's lease as stored in Redis, parsed defensively (a bad lease is ignored and logged)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerLease:
    """A live worker as its lease describes it."""

    worker_id: str
    """The id the worker publishes its blocks under."""
    epoch: int
    """Generation of the worker's entries; only entries of this epoch count."""
    address: str
    """host:port others dial for its gRPC service."""
    role: str
    """unified | prefill | decode."""
    block_size: int
    """Tokens per block the worker hashes with."""

    def to_fields(self) -> dict[str, str]:
        return {"epoch": str(self.epoch), "address": self.address, "role": self.role,
                "block_size": str(self.block_size)}


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def parse_lease(worker_id: str, fields: dict[bytes, bytes] | dict[str, str]) -> WorkerLease | None:
    """The lease in a Redis hash, or None (logged) when a field is missing or malformed; {} means none."""
    if not fields:
        return None
    data = {_text(k): _text(v) for k, v in fields.items()}
    try:
        lease = WorkerLease(worker_id=worker_id, epoch=int(data["epoch"]), address=data["address"],
                            role=data.get("role") or "unified", block_size=int(data.get("block_size") or 0))
    except (KeyError, ValueError):
        logger.warning("ignoring malformed lease of worker %r: %r", worker_id, data)
        return None
    if ":" not in lease.address or lease.epoch < 1:
        logger.warning("ignoring malformed lease of worker %r: %r", worker_id, data)
        return None
    return lease
