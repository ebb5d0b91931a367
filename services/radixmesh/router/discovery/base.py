"""The contract every discovery source implements.

A source watches some registry (a static list, Redis worker leases, Kubernetes pods) and
reports the complete set of workers it currently sees whenever that set changes. The
router diffs successive sets itself, so a source never has to track additions and
removals; it only has to be right about "what exists now".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

WORKER_ROLES = ("unified", "prefill", "decode")


@dataclass(frozen=True)
class WorkerEndpoint:
    """One worker as discovery sees it."""

    worker_id: str
    """Stable id: the pod name in Kubernetes, the lease key's id in Redis, host:port for static lists."""
    address: str
    """host:port of the worker's gRPC service."""
    role: str = "unified"
    """unified | prefill | decode."""
    metrics_port: int | None = None
    """Prometheus port, when the source knows it."""
    labels: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    """Free-form facts from the source (pod labels, lease fields), for logs and traces."""

    def __post_init__(self) -> None:
        assert self.role in WORKER_ROLES, f"worker {self.worker_id}: role {self.role!r} not in {WORKER_ROLES}"
        assert ":" in self.address, f"worker {self.worker_id}: address {self.address!r} is not host:port"


OnChange = Callable[[list[WorkerEndpoint]], Awaitable[None] | None]


class BaseDiscovery(ABC):
    """Watches a registry and calls `on_change` with the full current worker set on every change.

    `run` returns only when `stop` is called (or raises on a configuration error it cannot
    recover from); transient failures of the registry are retried inside with backoff and
    must not drop workers that were last seen healthy until the registry says otherwise.
    """

    @abstractmethod
    async def run(self, on_change: OnChange) -> None:
        """Report the initial set as soon as it is known, then every change, until stopped."""

    @abstractmethod
    async def stop(self) -> None:
        """Make `run` return soon; idempotent."""
