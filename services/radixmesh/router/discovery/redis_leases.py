"""Redis discovery: the workers whose KV-index lease is live (`radixmesh worker --redis-url`).

Polls the leases; when Redis is unreachable it keeps the last set it reported (the health
checks decide about those workers meanwhile) and retries with capped backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging

from redis.exceptions import RedisError

from radixmesh.common import aio
from radixmesh.index.reader import KVIndexReader
from radixmesh.router.discovery.base import BaseDiscovery, OnChange, WorkerEndpoint

logger = logging.getLogger(__name__)


class RedisLeaseDiscovery(BaseDiscovery):
    def __init__(self, reader: KVIndexReader, interval_s: float = 1.0, max_backoff_s: float = 10.0) -> None:
        self.reader = reader
        self.interval_s = interval_s
        self.max_backoff_s = max_backoff_s
        self._stopped = asyncio.Event()
        self._reported: list[WorkerEndpoint] | None = None

    async def run(self, on_change: OnChange) -> None:
        delay = self.interval_s
        while not self._stopped.is_set():
            try:
                endpoints = await self.poll()
                delay = self.interval_s
            except (RedisError, OSError) as exc:
                logger.warning("redis discovery: cannot read worker leases (%s); keeping %d known workers",
                               exc, len(self._reported or []))
                delay = min(self.max_backoff_s, delay * 2)
            else:
                if endpoints != self._reported:
                    self._reported = endpoints
                    logger.info("redis discovery: %d live workers: %s", len(endpoints),
                                ", ".join(f"{e.worker_id}={e.address}" for e in endpoints) or "none")
                    result = on_change(list(endpoints))
                    if inspect.isawaitable(result):
                        await result
            with contextlib.suppress(asyncio.TimeoutError):
                await aio.wait_for(self._stopped.wait(), delay)

    async def poll(self) -> list[WorkerEndpoint]:
        leases = await self.reader.live_leases(max_age_s=0)
        return [WorkerEndpoint(worker_id=lease.worker_id, address=lease.address, role=lease.role,
                               metrics_port=lease.metrics_port or None, labels={"epoch": str(lease.epoch)})
                for lease in sorted(leases.values(), key=lambda x: x.worker_id)]

    async def stop(self) -> None:
        self._stopped.set()
