"""Static discovery: a fixed `--workers host:port,...` list (worker id = host:port)."""

from __future__ import annotations

import asyncio
import inspect

from radixmesh.common.errors import invalid_argument
from radixmesh.router.discovery.base import BaseDiscovery, OnChange, WorkerEndpoint


def parse_workers(spec: str) -> list[WorkerEndpoint]:
    """Endpoints of a comma-separated host:port list; duplicates and malformed entries are errors."""
    addresses = [part.strip() for part in spec.split(",") if part.strip()]
    if not addresses:
        raise invalid_argument("--workers needs at least one host:port", "workers")
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise invalid_argument(f"--workers: {address!r} is not host:port", "workers")
    if len(set(addresses)) != len(addresses):
        raise invalid_argument("--workers lists an address twice", "workers")
    return [WorkerEndpoint(worker_id=a, address=a) for a in addresses]


class StaticDiscovery(BaseDiscovery):
    def __init__(self, endpoints: list[WorkerEndpoint]) -> None:
        self.endpoints = list(endpoints)
        self._stopped = asyncio.Event()

    async def run(self, on_change: OnChange) -> None:
        result = on_change(list(self.endpoints))
        if inspect.isawaitable(result):
            await result
        await self._stopped.wait()

    async def stop(self) -> None:
        self._stopped.set()
