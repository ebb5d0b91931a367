"""Worker identity and role, frozen once the listening address is known."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.disagg.transport.registry import AUTO, check_transport_id

WORKER_ROLES = ("unified", "prefill", "decode")
PEER_FETCH_MODES = ("auto", "always", "off")
"""auto: fetch a peer's prefix when the cost model says it beats computing it; always; off (compute)."""


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
    kv_transport: str = AUTO
    """Disaggregation and prefix sharing: KV transport id (grpc | cuda-ipc | nixl), or auto (picked per pair of
    workers: cuda-ipc on one host seeing each other's GPUs, else nixl when installed, else grpc); a decode worker
    asks for it, a prefill worker with a fixed id serves only it."""
    kv_lease_s: float = 60.0
    """Disaggregation: seconds a KV reservation (decode) or exported KV (prefill) is held at most."""
    prefill_timeout_s: float = 30.0
    """Decode: seconds to wait for a prefill worker's KV and first token before computing the prompt here
    (below kv_lease_s, so that a reservation outlives the wait)."""
    peer_fetch: str = "auto"
    """Prefix sharing: auto (fetch a router-named peer's cached prefix when cheaper than computing it, by
    measured rates) | always | off."""
    peer_fetch_timeout_s: float = 10.0
    """Prefix sharing: seconds a fetch from a peer may take before the prompt is computed here instead."""
    peer_fetch_min_tokens: int = 32
    """Prefix sharing: fetch only when the peer holds at least this many more prompt tokens than this worker."""
    http_port: int | None = None
    """Port of the OpenAI-compatible HTTP API over this worker's engine (0 picks a free one; None: none), for
    proxies whose endpoint picker chose this worker (unified workers only)."""
    served_model_name: str | None = None
    """Name HTTP clients pass as `model` (default: the model's own name)."""

    def __post_init__(self) -> None:
        if self.role not in WORKER_ROLES:
            raise invalid_argument(f"role must be one of {', '.join(WORKER_ROLES)} (got {self.role!r})", "role")
        if self.block_size < 1:
            raise invalid_argument(f"block_size must be >= 1 (got {self.block_size})", "block_size")
        check_transport_id(self.kv_transport)
        if not 0 < self.kv_lease_s <= 3600 or not 0 < self.prefill_timeout_s <= 3600:
            raise invalid_argument("kv_lease_s and prefill_timeout_s must be in (0, 3600] seconds", "kv_lease_s")
        if self.role == "decode" and self.prefill_timeout_s >= self.kv_lease_s:
            raise invalid_argument(f"prefill_timeout_s ({self.prefill_timeout_s:g}) must be below kv_lease_s "
                                   f"({self.kv_lease_s:g}): a reservation must outlive the wait for its KV",
                                   "prefill_timeout_s")
        if self.peer_fetch not in PEER_FETCH_MODES:
            raise invalid_argument(f"peer_fetch must be one of {', '.join(PEER_FETCH_MODES)} (got {self.peer_fetch!r})",
                                   "peer_fetch")
        if not 0 < self.peer_fetch_timeout_s <= 3600 or self.peer_fetch_min_tokens < 1:
            raise invalid_argument("peer_fetch_timeout_s must be in (0, 3600] seconds and peer_fetch_min_tokens >= 1",
                                   "peer_fetch_timeout_s")
        if self.http_port is not None and (not 0 <= self.http_port <= 65535 or self.role != "unified"):
            raise invalid_argument(f"http_port needs a unified worker and a port in [0, 65535] (got "
                                   f"{self.http_port} on a {self.role} worker)", "http_port")
        if self.advertise_address and ":" not in self.advertise_address:
            raise invalid_argument(f"advertise_address must be host:port (got {self.advertise_address!r})",
                                   "advertise_address")

    def serving_transport(self, asked: str) -> str:
        """What an exporting worker uses for a peer that asked for `asked`: its own fixed id, or with auto here
        what the peer asked (auto included: the scheduler picks). INVALID_ARGUMENT when two fixed ids differ."""
        check_transport_id(asked or AUTO)
        if self.kv_transport == AUTO:
            return asked or AUTO
        if asked in ("", AUTO, self.kv_transport):
            return self.kv_transport
        raise invalid_argument(f"this worker sends KV over {self.kv_transport}, not {asked}: run both tiers with the "
                               "same --kv-transport (or auto)", "kv_transport")

    def resolve(self, listen_address: str) -> WorkerConfig:
        """Fill the advertise address and worker id from the address the server bound."""
        address = self.advertise_address or listen_address
        return dataclasses.replace(self, advertise_address=address, worker_id=self.worker_id or address)
