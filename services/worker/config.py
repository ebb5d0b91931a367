"""Worker identity and role, frozen once the listening address is known."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from radixmesh.common.errors import invalid_argument

WORKER_ROLES = ("unified", "prefill", "decode")


@dataclass(frozen=True)
class WorkerConfig:
    """Who this worker is to routers and the KV-cache index."""

    role: str = "unified"
    """unified (prefill + decode), or a disaggregation tier: prefill | decode."""
    worker_id: str = ""
    """Stable id in the index and in routing decisions; empty: the advertise address."""
    advertise_address: str = ""
    """host:port that routers and other workers dial; empty: the listening host:port."""
    block_size: int = 16
    """Tokens per block of the KV-cache events this worker publishes."""
    redis_url: str | None = None
    """Redis of the KV-cache index and worker leases; None: publish nothing."""

    def __post_init__(self) -> None:
        if self.role not in WORKER_ROLES:
            raise invalid_argument(f"role must be one of {', '.join(WORKER_ROLES)} (got {self.role!r})", "role")
        if self.block_size < 1:
            raise invalid_argument(f"block_size must be >= 1 (got {self.block_size})", "block_size")
        if self.advertise_address and ":" not in self.advertise_address:
            raise invalid_argument(f"advertise_address must be host:port (got {self.advertise_address!r})",
                                   "advertise_address")

    def resolve(self, listen_address: str) -> WorkerConfig:
        """Fill the advertise address and worker id from the address the server bound."""
        address = self.advertise_address or listen_address
        return dataclasses.replace(self, advertise_address=address, worker_id=self.worker_id or address)
