"""The Redis key layout of the KV-cache index (one namespace per cluster).

    {ns}:workers              SET   ids of workers that ever published (the janitor prunes it)
    {ns}:epoch:{worker}       INT   incremented on every writer start (and resync); never expires
    {ns}:lease:{worker}       STR   a serialized radixmesh.v1.WorkerLease; PX lease_ttl, renewed by heartbeat
    {ns}:b:{hash}             HASH  worker id -> epoch in which the worker stored the block
    {ns}:spec:{hash}          STR   worker id a router just sent this prefix to; PEXPIRE speculative_ttl
    {ns}:wb:{worker}:{epoch}  SET   block hashes a worker stored in one epoch (for cleanup)
    {ns}:wepochs:{worker}     SET   epochs of a worker that still have a `wb` set

Block hashes appear as 16 lowercase hex digits. An entry counts only while its worker's
lease exists and carries the same epoch; anything else is stale and is cleaned lazily.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IndexKeys:
    """Builds the key names of one namespace."""

    namespace: str
    """The cluster's key prefix."""

    @property
    def workers(self) -> str:
        return f"{self.namespace}:workers"

    def epoch(self, worker_id: str) -> str:
        return f"{self.namespace}:epoch:{worker_id}"

    def lease(self, worker_id: str) -> str:
        return f"{self.namespace}:lease:{worker_id}"

    def block(self, block_hash: int) -> str:
        return f"{self.namespace}:b:{block_hash:016x}"

    def speculative(self, block_hash: int) -> str:
        return f"{self.namespace}:spec:{block_hash:016x}"

    def worker_blocks(self, worker_id: str, epoch: int) -> str:
        return f"{self.namespace}:wb:{worker_id}:{epoch}"

    def worker_epochs(self, worker_id: str) -> str:
        return f"{self.namespace}:wepochs:{worker_id}"


def parse_block_member(member: bytes | str) -> int | None:
    """A block hash as stored in a `wb` set, or None when the member is malformed."""
    text = member.decode() if isinstance(member, bytes) else member
    try:
        value = int(text, 16)
    except ValueError:
        return None
    return value if len(text) == 16 else None
