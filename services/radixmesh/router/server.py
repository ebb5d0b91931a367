"""Run a router: discovery -> registry -> health checks, a policy, and RouterService until SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from typing import TYPE_CHECKING

from radixmesh.common import aio
from radixmesh.common.grpc_server import GrpcServer, GrpcServerConfig
from radixmesh.common.lane import LaneMethod
from radixmesh.common.readiness import Readiness
from radixmesh.index.reader import KVIndexReader
from radixmesh.protocol import router_pb2_grpc, worker_pb2
from radixmesh.router import metrics
from radixmesh.router.config import RouterConfig
from radixmesh.router.discovery.base import BaseDiscovery
from radixmesh.router.dispatch import RequestRouter
from radixmesh.router.epp.config import EppConfig
from radixmesh.router.health_checker import HealthChecker
from radixmesh.router.policies import create_policy
from radixmesh.router.service import SERVICE_NAME, RouterServicer
from radixmesh.router.worker_client import WorkerClient
from radixmesh.router.workers import WorkerHandle, WorkerRegistry

if TYPE_CHECKING:
    from radixmesh.router.epp.app import EndpointPickerApp

logger = logging.getLogger(__name__)
GAUGE_INTERVAL_S = 1.0


def make_reader(config: RouterConfig) -> KVIndexReader | None:
    """A KV-index reader when the router has a Redis URL (connects lazily)."""
    if not config.redis_url:
        return None
    from radixmesh.index.config import IndexConfig
    from radixmesh.index.writer import connect, connect_inline

    index_config = IndexConfig(redis_url=config.redis_url, namespace=config.index_namespace,
                               block_size=config.block_size)
    inline = connect_inline(index_config) if config.index_lookup == "inline" else None
    return KVIndexReader(index_config, connect(index_config), inline)


class RouterApp:
    """All parts of one router, started and stopped together (in a process, or inside a test). Without a
    server config there is no RouterService: a gateway routes in its own process (`--embedded-router`) through
    `servicer` and reads `not_ready_reason`. With an `epp` config the router is also an inference pool's
    endpoint picker (radixmesh.router.epp) over the same workers and policy."""

    def __init__(self, server_config: GrpcServerConfig | None, config: RouterConfig, discovery: BaseDiscovery,
                 reader: KVIndexReader | None = None, epp: EppConfig | None = None) -> None:
        self.config = config
        self.discovery = discovery
        self.reader = reader if reader is not None else make_reader(config)
        self.registry = WorkerRegistry(config.health, config.breaker,
                                       functools.partial(WorkerClient, use_lane=config.generate_transport == "lane"))
        self.checker = HealthChecker(self.registry, config.health)
        self.policy = create_policy(config.policy, config, reader=self.reader)
        self.router = RequestRouter(config, self.registry, self.policy,
                                    prefill_policy=create_policy(config.policy, dataclasses.replace(
                                        config, sweep_interval_s=0), reader=self.reader),  # one sweeper is enough
                                    reader=self.reader)
        self.servicer = RouterServicer(self.router)
        self.server: GrpcServer | None = None
        if server_config is not None:
            self.server = GrpcServer(server_config, "router", [SERVICE_NAME])
            router_pb2_grpc.add_RouterServiceServicer_to_server(self.servicer, self.server.server)
            self.server.add_lane({"Generate": LaneMethod(worker_pb2.GenerateRequest, self.servicer.Generate,
                                                         f"/{SERVICE_NAME}/Generate")})
        self.readiness = self.server.readiness if self.server is not None else Readiness("router")
        self.readiness.add("workers", "a healthy worker", detail="no worker discovered yet")
        if self.reader is not None:
            self.readiness.add("index", f"the KV-cache index at {config.redis_url}", required=False, up=True)
        self.epp: EndpointPickerApp | None = None
        if epp is not None:
            from radixmesh.router.epp.app import EndpointPickerApp

            self.epp = EndpointPickerApp(epp, self.registry, self.policy, config.block_size,
                                         server_config.host if server_config else "127.0.0.1",
                                         server_config.tls if server_config else None, self.router.adapters)
        self.checker.on_change.append(self.refresh_readiness)
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def not_ready_reason(self) -> str:
        return "" if self.readiness.ready else self.readiness.reason

    def refresh_readiness(self) -> None:
        """SERVING while at least one worker is healthy; the reason names what the workers lack."""
        workers = self.registry.all()
        healthy = [w for w in workers if w.health.healthy]
        self.readiness.set("workers", bool(healthy), workers_detail(workers, len(healthy)))
        if self.reader is not None:  # without it routing falls back to approx-tree: degraded, still ready
            index_up = self.policy.active_policy() == self.policy.policy_id
            self.readiness.set("index", index_up, "" if index_up else "routing with approx-tree meanwhile")
        if self.epp is not None:
            self.epp.refresh()

    async def start(self) -> None:
        await self.policy.start()
        await self.router.prefill.start()
        self._tasks = [asyncio.create_task(self.discovery.run(self.registry.apply), name="discovery"),
                       asyncio.create_task(self._update_gauges(), name="router-gauges")]
        if self.server is not None:
            await self.server.start()
            self.servicer.lane_port = self.server.lane_port
            print(f"radixmesh router: policy {self.config.policy}, index {'on' if self.reader else 'off'}",
                  flush=True)
        if self.epp is not None:
            await self.epp.start()

    async def stop(self) -> None:
        """Drain the server, then stop discovery, probes, the policy and the worker channels."""
        if self.server is not None:
            if self.epp is not None:
                await self.epp.stop(self.server.config.drain_timeout_s)
            await self.server.drain()
        await self.close_parts()

    async def close_parts(self) -> None:
        if self.epp is not None:
            await self.epp.stop(1.0)  # open picks finish (after a drain, nothing is left to wait for)
        await self.discovery.stop()
        await aio.cancel_and_wait(*self._tasks)
        await self.checker.close()
        await self.policy.close()
        await self.router.prefill.close()
        await self.registry.close()
        if self.reader is not None:
            await self.reader.close()

    async def _update_gauges(self) -> None:
        while True:
            self.refresh_readiness()  # also after changes no probe reports (a request marking a worker down)
            metrics.HEALTHY_WORKERS.set(sum(1 for w in self.registry.all() if w.health.healthy))
            metrics.update_worker_gauges(self.registry.all())
            metrics.FALLBACK.set(1 if self.policy.active_policy() != self.policy.policy_id else 0)
            await asyncio.sleep(GAUGE_INTERVAL_S)


def workers_detail(workers: list[WorkerHandle], num_healthy: int, max_named: int = 3) -> str:
    """What the router's readiness says about its workers."""
    if not workers:
        return "no worker discovered yet"
    if num_healthy:
        return f"{num_healthy} of {len(workers)} workers healthy"
    named = ", ".join(f"{w.worker_id} ({w.health.last_error or 'not probed yet'})" for w in workers[:max_named])
    more = f" and {len(workers) - max_named} more" if len(workers) > max_named else ""
    return f"none of {len(workers)} workers is healthy: {named}{more}"


async def serve_router(server_config: GrpcServerConfig, config: RouterConfig, discovery: BaseDiscovery,
                       epp: EppConfig | None = None) -> int:
    app = RouterApp(server_config, config, discovery, epp=epp)
    assert app.server is not None
    try:
        await app.start()
        await app.server.run_until_signal(functools.partial(app.servicer.drain_streams, server_config.drain_timeout_s))
        return 0
    finally:
        await app.close_parts()
