"""Active health checks: one probing task per worker, feeding its health state and load.

The probe (a `WorkerClient.probe` in the service, a fake in tests) is called every
`interval_s`; results go through the worker's `HealthState` thresholds. A probe also
refreshes the worker's load snapshot and the id it publishes index entries under.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from radixmesh.common import aio
from radixmesh.router.config import HealthConfig
from radixmesh.router.workers import WorkerHandle, WorkerRegistry

logger = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, registry: WorkerRegistry, config: HealthConfig) -> None:
        self.registry = registry
        self.config = config
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.on_change: list[Callable[[], None]] = []
        """Called whenever a worker's healthy flag flips (the router's readiness follows)."""
        registry.on_added.append(self.watch)

    def watch(self, handle: WorkerHandle) -> None:
        """Start probing a new worker (called by the registry for every handle it adds)."""
        old = self._tasks.pop(handle.worker_id, None)
        if old is not None:
            old.cancel()
        self._tasks[handle.worker_id] = asyncio.get_running_loop().create_task(
            self._run(handle), name=f"health-{handle.worker_id}")

    async def check_once(self, handle: WorkerHandle) -> None:
        try:
            result = await aio.wait_for(handle.client.probe(self.config.timeout_s), self.config.timeout_s * 2.5)
        except asyncio.TimeoutError:
            ok, error, load, reported_id, role, http_port, disagg = False, "probe timed out", None, "", "", None, None
        else:
            ok, error, load, reported_id = result.ok, result.error, result.load, result.worker_id
            role, http_port = result.role, (result.http_port if load is not None else None)
            disagg = result.disagg
        if load is not None:
            handle.load = load
        if disagg is not None:
            handle.transfers = disagg
        if reported_id:
            handle.index_id = reported_id
        if http_port is not None:
            handle.http_port = http_port
        if role and role != handle.reported_role:
            logger.info("router: worker %s reports role %s", handle.worker_id, role)
            handle.reported_role = role
        if handle.health.on_probe(ok, error):
            if ok:
                logger.warning("router: worker %s at %s is healthy", handle.worker_id, handle.address)
            else:
                logger.warning("router: worker %s at %s is unhealthy: %s", handle.worker_id, handle.address, error)
            for callback in self.on_change:
                callback()

    async def _run(self, handle: WorkerHandle) -> None:
        while self.registry.get(handle.worker_id) is handle:
            await self.check_once(handle)
            await asyncio.sleep(self.config.interval_s)
        self._tasks.pop(handle.worker_id, None)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        await aio.cancel_and_wait(*tasks)
