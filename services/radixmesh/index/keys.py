"""The Redis key layout of the KV-cache index (one namespace per cluster).

    {ns}:workers              SET   ids of workers that ever published (the janitor prunes it)
    {ns}:epoch:{worker}       INT   incremented on every writer start (and resync); never expires
    {ns}:lease:{worker}       STR   a serialized radixmesh.v1.WorkerLease; PX lease_ttl, renewed by heartbeat
    {ns}:leasever             INT   incremented whenever a worker writes a new lease (start, resync, a change of
                                    its LoRA adapters) or withdraws one: readers cache the lease set and read it
                                    again when it moved
    {ns}:b:{hash}             HASH  worker id -> epoch in which the worker stored the block (KV on its device)
    {ns}:bh:{hash}            HASH  the same for blocks whose KV is in the worker's host tier only
                                    (hierarchical cache); a block is under b: or bh: of a worker, never both
    {ns}:spec:{hash}          STR   worker id a router just sent this prefix to; PEXPIRE speculative_ttl
    {ns}:wb:{worker}:{epoch}  SET   block hashes a worker stored in one epoch (for cleanup)
    {ns}:wbh:{worker}:{epoch} SET   the same for its host-tier blocks
    {ns}:wepochs:{worker}     SET   epochs of a worker that still have a `wb` set

Block hashes appear as 16 lowercase hex digits. An entry counts only while its worker's
lease exists and carries the same epoch; anything else is stale and is cleaned lazily.
The host-tier keys are additions: readers that predate them see host-tier blocks as not held
(a miss), which is what those blocks were before the host tier existed.
"""

from __future__ import annotations

from dataclasses import dataclass

DEVICE_TIER, HOST_TIER = "device", "host"
TIERS = (DEVICE_TIER, HOST_TIER)
"""Where a worker holds a block's KV: its device pool, or (hierarchical cache) its host tier."""


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

    @property
    def lease_version(self) -> str:
        return f"{self.namespace}:leasever"

    def block(self, block_hash: int) -> str:
        return f"{self.namespace}:b:{block_hash:016x}"

    def host_block(self, block_hash: int) -> str:
        return f"{self.namespace}:bh:{block_hash:016x}"

    def tier_block(self, block_hash: int, tier: str) -> str:
        """The block's key in `tier` (device | host)."""
        return self.host_block(block_hash) if tier == HOST_TIER else self.block(block_hash)

    def speculative(self, block_hash: int) -> str:
        return f"{self.namespace}:spec:{block_hash:016x}"

    def worker_blocks(self, worker_id: str, epoch: int) -> str:
        return f"{self.namespace}:wb:{worker_id}:{epoch}"

    def worker_host_blocks(self, worker_id: str, epoch: int) -> str:
        return f"{self.namespace}:wbh:{worker_id}:{epoch}"

    def tier_blocks(self, worker_id: str, epoch: int, tier: str) -> str:
        """The `wb` (device) or `wbh` (host) set of a worker's epoch."""
        if tier == HOST_TIER:
            return self.worker_host_blocks(worker_id, epoch)
        return self.worker_blocks(worker_id, epoch)

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
