"""Active health checks: one probing task per worker, feeding its health state and load, and a health watch.

The probe (a `WorkerClient.probe` in the service, a fake in tests) is called every
`interval_s`; results go through the worker's `HealthState` thresholds. A probe also
refreshes the worker's load snapshot and the id it publishes index entries under. A worker
that reports draining leaves routing at once.

The watch (grpc.health.v1 Watch, where the client has `watch_serving`) is the drain notice: a
worker that turns NOT_SERVING (SIGTERM, its engine died) is taken out of routing the moment it
says so, not after `failure_threshold` probes; when the watch stream breaks (the worker died or
restarted) the worker is probed at once and taken out if that probe fails too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from radixmesh.common import aio
from radixmesh.common.errors import RadixMeshError
from radixmesh.router.config import HealthConfig
from radixmesh.router.workers import WorkerHandle, WorkerRegistry

logger = logging.getLogger(__name__)
WATCH_RETRY_MIN_S = 0.2
"""First wait before a broken health watch is opened again (doubles up to WATCH_RETRY_MAX_S)."""
WATCH_RETRY_MAX_S = 2.0


class HealthChecker:
    def __init__(self, registry: WorkerRegistry, config: HealthConfig) -> None:
        self.registry = registry
        self.config = config
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._watches: dict[str, asyncio.Task[None]] = {}
        self.on_change: list[Callable[[], None]] = []
        """Called whenever a worker's healthy flag flips (the router's readiness follows)."""
        registry.on_added.append(self.watch)

    def watch(self, handle: WorkerHandle) -> None:
        """Start probing a new worker (called by the registry for every handle it adds)."""
        old = self._tasks.pop(handle.worker_id, None)
        if old is not None:
            old.cancel()
        old = self._watches.pop(handle.worker_id, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self._tasks[handle.worker_id] = loop.create_task(self._run(handle), name=f"health-{handle.worker_id}")
        if getattr(handle.client, "watch_serving", None) is not None:
            self._watches[handle.worker_id] = loop.create_task(self._watch(handle), name=f"watch-{handle.worker_id}")

    async def check_once(self, handle: WorkerHandle) -> bool:
        """Probe the worker once; whether it passed."""
        draining = False
        try:
            result = await aio.wait_for(handle.client.probe(self.config.timeout_s), self.config.timeout_s * 2.5)
        except asyncio.TimeoutError:
            ok, error, load, reported_id, role, http_port, disagg = False, "probe timed out", None, "", "", None, None
        else:
            ok, error, load, reported_id = result.ok, result.error, result.load, result.worker_id
            role, http_port = result.role, (result.http_port if load is not None else None)
            disagg = result.disagg
            draining = result.draining
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
        if draining:
            self.take_out(handle, "draining")
        elif handle.health.on_probe(ok, error):
            if ok:
                logger.warning("router: worker %s at %s is healthy", handle.worker_id, handle.address)
            else:
                logger.warning("router: worker %s at %s is unhealthy: %s", handle.worker_id, handle.address, error)
            self._changed()
        return ok

    def take_out(self, handle: WorkerHandle, why: str) -> None:
        """Out of routing now (the probes bring it back once it passes them)."""
        if handle.health.mark_down(why):
            logger.warning("router: worker %s at %s is out of routing: %s", handle.worker_id, handle.address, why)
            self._changed()

    def _changed(self) -> None:
        for callback in self.on_change:
            callback()

    async def _watch(self, handle: WorkerHandle) -> None:
        """Follow the worker's health watch while it is registered (see the module docstring)."""
        retry_s = WATCH_RETRY_MIN_S
        while self.registry.get(handle.worker_id) is handle:
            try:
                async for serving in handle.client.watch_serving():
                    retry_s = WATCH_RETRY_MIN_S
                    if not serving:
                        self.take_out(handle, "NOT_SERVING (draining or not ready)")
            except RadixMeshError:
                pass
            if self.registry.get(handle.worker_id) is not handle:
                break
            if not await self.check_once(handle):
                self.take_out(handle, handle.health.last_error or "its health watch broke")
            await asyncio.sleep(retry_s)
            retry_s = min(WATCH_RETRY_MAX_S, retry_s * 2)
        self._watches.pop(handle.worker_id, None)

    async def _run(self, handle: WorkerHandle) -> None:
        while self.registry.get(handle.worker_id) is handle:
            await self.check_once(handle)
            await asyncio.sleep(self.config.interval_s)
        self._tasks.pop(handle.worker_id, None)

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *self._watches.values()]
        self._tasks.clear()
        self._watches.clear()
        await aio.cancel_and_wait(*tasks)
