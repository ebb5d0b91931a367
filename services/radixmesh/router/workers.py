"""The router's view of its workers: endpoint, health, circuit breaker, last load, in-flight work.

`WorkerRegistry.apply` is the discovery callback: it diffs the reported set against the
current one, creating a handle (and its transport client, through a factory) for each new
worker and closing the clients of workers that disappeared.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixmesh.common import aio
from radixmesh.router.breaker import CircuitBreaker, CircuitState
from radixmesh.router.config import BreakerConfig, HealthConfig
from radixmesh.router.discovery.base import WorkerEndpoint
from radixmesh.router.health import HealthState
from radixmesh.wire.load import WorkerLoad

logger = logging.getLogger(__name__)
RETIRE_POLL_S = 0.1
RETIRE_MAX_S = 3600.0
"""Longest a removed worker's client stays open for its requests (their workers cut them at their drain timeout)."""


@dataclass(eq=False)
class WorkerHandle:
    """One worker as the router tracks it."""

    endpoint: WorkerEndpoint
    health: HealthState
    breaker: CircuitBreaker
    client: Any = None
    """Transport to the worker (a gRPC client in the service, a fake in tests)."""
    load: WorkerLoad = field(default_factory=WorkerLoad)
    index_id: str = ""
    """The id the worker publishes index entries under (from its GetLoad; defaults to worker_id)."""
    reported_role: str = ""
    """The role the worker reports in GetLoad ("" until probed); wins over the discovery source's."""
    http_port: int = 0
    """The port of the worker's OpenAI HTTP API, as its GetLoad reports it (0: none, or not probed yet)."""
    transfers: Any = None
    """The worker's DisaggStats from its last GetLoad (its --kv-transport, transfers by transport), or None."""
    num_inflight: int = 0
    """Requests this router has open on the worker."""
    inflight_prefill_tokens: int = 0
    """Uncached prompt tokens of open requests that have not produced a token yet."""

    @property
    def worker_id(self) -> str:
        return self.endpoint.worker_id

    @property
    def address(self) -> str:
        return self.endpoint.address

    @property
    def role(self) -> str:
        """unified | prefill | decode: as the worker reports it, else as discovery says."""
        return self.reported_role or self.endpoint.role

    @property
    def http_endpoint(self) -> str:
        """host:port of the worker's OpenAI HTTP API (its gRPC address's host), "" when it serves none."""
        if not self.http_port:
            return ""
        host = self.address.rsplit(":", 1)[0]
        return f"{host}:{self.http_port}"

    @property
    def is_available(self) -> bool:
        """Healthy and its circuit lets a request through."""
        return self.health.healthy and self.breaker.can_route()

    @property
    def circuit_state(self) -> CircuitState:
        return self.breaker.state

    def begin_request(self, uncached_tokens: int) -> bool:
        """Count a request sent here; returns whether it is the circuit breaker's half-open trial."""
        self.num_inflight += 1
        self.inflight_prefill_tokens += uncached_tokens
        return self.breaker.on_dispatch()

    def first_token(self, uncached_tokens: int) -> None:
        self.inflight_prefill_tokens = max(0, self.inflight_prefill_tokens - uncached_tokens)

    def end_request(self, uncached_tokens: int, first_token_seen: bool) -> None:
        self.num_inflight = max(0, self.num_inflight - 1)
        if not first_token_seen:
            self.first_token(uncached_tokens)


ClientFactory = Callable[[WorkerEndpoint], Any]


class WorkerRegistry:
    """Workers by id; fed by one discovery source."""

    def __init__(self, health: HealthConfig, breaker: BreakerConfig, client_factory: ClientFactory,
                 clock: Callable[[], float] | None = None) -> None:
        self.health_config = health
        self.breaker_config = breaker
        self.client_factory = client_factory
        self.clock = clock
        self._workers: dict[str, WorkerHandle] = {}
        self.on_added: list[Callable[[WorkerHandle], None]] = []
        """Called for every new handle (the health checker starts probing it)."""
        self._retiring: dict[asyncio.Task[None], WorkerHandle] = {}
        """Removed workers whose clients close once their open requests end."""

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, worker_id: str) -> WorkerHandle | None:
        return self._workers.get(worker_id)

    def all(self) -> list[WorkerHandle]:
        return [self._workers[k] for k in sorted(self._workers)]

    def available(self, *roles: str) -> list[WorkerHandle]:
        """Workers of these roles (default: unified) that may take a request now, in id order."""
        wanted = roles or ("unified",)
        return [w for w in self.all() if w.role in wanted and w.is_available]

    def by_index_id(self) -> dict[str, WorkerHandle]:
        return {(w.index_id or w.worker_id): w for w in self._workers.values()}

    async def apply(self, endpoints: list[WorkerEndpoint]) -> None:
        """Make the registry hold exactly `endpoints` (the discovery callback); closes removed clients, each once
        the requests open on it ended (a worker leaves discovery when it starts draining: its streams go on)."""
        for handle in self.replace(endpoints):
            if handle.num_inflight:
                self._retire(handle)
            else:
                await _close_client(handle)

    def _retire(self, handle: WorkerHandle) -> None:
        logger.info("router: worker %s left with %d requests open; its client closes once they end",
                    handle.worker_id, handle.num_inflight)
        task = asyncio.get_running_loop().create_task(self._close_when_idle(handle),
                                                      name=f"retire-{handle.worker_id}")
        self._retiring[task] = handle
        task.add_done_callback(lambda done: self._retiring.pop(done, None))

    @staticmethod
    async def _close_when_idle(handle: WorkerHandle) -> None:
        deadline = time.monotonic() + RETIRE_MAX_S
        while handle.num_inflight and time.monotonic() < deadline:
            await asyncio.sleep(RETIRE_POLL_S)
        await _close_client(handle)

    def replace(self, endpoints: list[WorkerEndpoint]) -> list[WorkerHandle]:
        """The synchronous part of `apply`: returns the removed handles, whose clients the caller closes."""
        wanted = {e.worker_id: e for e in endpoints}
        removed = [self._remove(w) for w in list(self._workers) if w not in wanted]
        for worker_id, endpoint in wanted.items():
            current = self._workers.get(worker_id)
            if current is not None and current.endpoint == endpoint:
                continue
            if current is not None:
                removed.append(self._remove(worker_id))
            self._add(endpoint)
        return removed

    def _add(self, endpoint: WorkerEndpoint) -> None:
        breaker = CircuitBreaker(self.breaker_config, self.clock) if self.clock else CircuitBreaker(self.breaker_config)
        handle = WorkerHandle(endpoint, HealthState(self.health_config), breaker, self.client_factory(endpoint))
        self._workers[endpoint.worker_id] = handle
        logger.info("router: worker %s at %s (%s) added", endpoint.worker_id, endpoint.address, endpoint.role)
        for callback in self.on_added:
            callback(handle)

    def _remove(self, worker_id: str) -> WorkerHandle:
        handle = self._workers.pop(worker_id)
        logger.info("router: worker %s at %s removed", worker_id, handle.address)
        return handle

    async def close(self) -> None:
        retiring = list(self._retiring.items())
        await aio.cancel_and_wait(*(task for task, _ in retiring))
        for handle in [*self.replace([]), *(h for task, h in retiring if task.cancelled())]:
            await _close_client(handle)


async def _close_client(handle: WorkerHandle) -> None:
    close = getattr(handle.client, "close", None)
    if close is not None:
        result = close()
        if inspect.isawaitable(result):
            await result
