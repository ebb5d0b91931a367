"""Run a worker: start the scheduler process, serve WorkerService until SIGTERM, drain, stop.

Drain (SIGTERM): NOT_SERVING at once (routers watching its health stop sending it requests), new Generate
calls end DRAINING (routers retry them elsewhere), running sequences get --drain-timeout-s to finish, and
the rest end DRAINING: routers move them to another worker from the tokens already sent.

The scheduler runs in its own process (EngineClient); this process is only the asyncio gRPC
front end, so request I/O never shares the GIL with the model.

Readiness: the scheduler process is the one required dependency (NOT_SERVING once it died). The
KV-cache index (Redis) and the grammar service are optional: without the index the worker still
serves (routers fall back to approx-tree routing, and Redis discovery cannot list it meanwhile), and
without the grammar service the engine compiles grammars itself. Either one down only makes the
worker degraded (logged once per change); both are retried in the background, never fatal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import sys
from typing import TYPE_CHECKING

from radixmesh.common import aio
from radixmesh.common.errors import invalid_argument
from radixmesh.common.grpc_server import GrpcServer, GrpcServerConfig
from radixmesh.common.lane import LaneMethod
from radixmesh.engine.client import EngineClient
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.disagg.transport.registry import AUTO, check_transport_device, describe_auto
from radixmesh.protocol import worker_pb2, worker_pb2_grpc
from radixmesh.worker import metrics
from radixmesh.worker.config import WorkerConfig
from radixmesh.worker.service import SERVICE_NAME, WorkerServicer

if TYPE_CHECKING:
    from radixmesh.index.writer import KVIndexWriter
    from radixmesh.worker.http_api import WorkerHttpApi

logger = logging.getLogger(__name__)
ENGINE_WATCH_S = 1.0
DEPENDENCY_CHECK_S = 2.0


async def serve_worker(server_config: GrpcServerConfig, config: WorkerConfig, engine_config: EngineConfig) -> int:
    print(f"radixmesh worker: loading {engine_config.model or 'the default model'} ...", file=sys.stderr, flush=True)
    if config.redis_url is not None:
        engine_config = dataclasses.replace(engine_config, kv_events_block_size=config.block_size)
    if config.role != "unified" and engine_config.enable_dp_attention:
        raise invalid_argument(f"a {config.role} worker does not run with --enable-dp-attention yet (KV transports "
                               "read one pool; data-parallel attention keeps one per rank): use role unified",
                               "enable_dp_attention")
    if config.role != "unified":
        check_transport_device(config.kv_transport, engine_config.resolve().device)
        chosen = f"auto: {describe_auto()}" if config.kv_transport == AUTO else config.kv_transport
        print(f"radixmesh worker: {config.role}, KV transport {chosen}", file=sys.stderr, flush=True)
    client = await EngineClient.start(engine_config)
    publisher, servicer = None, None
    http_api: WorkerHttpApi | None = None
    try:
        server = GrpcServer(server_config, "worker", [SERVICE_NAME], {"radixmesh.role": config.role})
        servicer = WorkerServicer(client, config)
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server.server)
        server.add_lane({"Generate": LaneMethod(worker_pb2.GenerateRequest, servicer.Generate,
                                                f"/{SERVICE_NAME}/Generate")})
        server.readiness.add("engine", "the scheduler process", up=True)
        await server.start()
        servicer.lane_port = server.lane_port
        config = servicer.resolve(server.address)
        publisher = await attach_kv_events(client, config, server.metrics_port or 0)
        if publisher is not None:
            servicer.index_epoch = lambda: publisher.epoch  # peers fetch only entries of this epoch
        watchers = [asyncio.create_task(_watch_engine(client, server)),
                    asyncio.create_task(_watch_optional(server, publisher, engine_config.grammar_service))]
        stats = metrics.start_worker_metrics(client.get_server_info, servicer.load, config.role, config.worker_id)
        if config.http_port is not None:
            from radixmesh.worker.http_api import WorkerHttpApi

            http_api = WorkerHttpApi(client, server_config.host, config.http_port, config.served_model_name,
                                     min(server_config.drain_timeout_s, 30.0))
            servicer.http_port = await http_api.start()
        await server.run_until_signal(functools.partial(servicer.drain_streams, server_config.drain_timeout_s))
        await aio.cancel_and_wait(*watchers, stats)
        return 0
    finally:
        if http_api is not None:
            await http_api.stop()  # open HTTP requests finish while the gRPC port drained
        if publisher is not None:
            await publisher.close()  # withdraws the lease and this worker's index entries
        if servicer is not None:
            await servicer.close()
        await client.shutdown()


async def attach_kv_events(client: EngineClient, config: WorkerConfig, metrics_port: int = 0) -> KVIndexWriter | None:
    """Publish the scheduler's block events (stored / removed / cleared) to the KV-cache index under
    this worker's lease; with no --redis-url nothing is published and None is returned."""
    if config.redis_url is None:
        return None
    from radixmesh.index.config import IndexConfig
    from radixmesh.index.publisher import start_publisher
    from radixmesh.index.writer import WriterIdentity

    identity = WriterIdentity(config.worker_id, config.advertise_address, config.role, metrics_port)
    return await start_publisher(client, IndexConfig(redis_url=config.redis_url, block_size=config.block_size),
                                 identity)


async def _watch_engine(client: EngineClient, server: GrpcServer) -> None:
    """Report NOT_SERVING once the scheduler process died, so routers stop sending here."""
    while client.is_alive:
        await asyncio.sleep(ENGINE_WATCH_S)
    logger.error("the scheduler process is gone; reporting NOT_SERVING")
    server.readiness.set("engine", False, "the scheduler process exited")


async def _watch_optional(server: GrpcServer, publisher: KVIndexWriter | None, grammar_service: str | None) -> None:
    """Keep the optional dependencies' states current: the index's Redis and the grammar service."""
    if publisher is not None:
        server.readiness.add("index", f"the KV-cache index at {publisher.config.redis_url}", required=False)
    grammar = _GrammarProbe(grammar_service) if grammar_service else None
    if grammar is not None:
        server.readiness.add("grammar", f"the grammar service at {grammar_service}", required=False)
    if publisher is None and grammar is None:
        return
    try:
        while True:
            if publisher is not None:
                up, detail = await _redis_up(publisher)
                server.readiness.set("index", up, detail)
            if grammar is not None:
                server.readiness.set("grammar", *await grammar.check())
            await asyncio.sleep(DEPENDENCY_CHECK_S)
    finally:
        if grammar is not None:
            await grammar.close()


async def _redis_up(publisher: KVIndexWriter) -> tuple[bool, str]:
    try:
        await aio.wait_for(publisher.redis.ping(), DEPENDENCY_CHECK_S)
    except Exception as exc:  # any failure means "down"; the writer retries on its own
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


class _GrammarProbe:
    """grpc.health.v1 of the grammar service (the engine falls back to compiling locally while it is down)."""

    def __init__(self, address: str) -> None:
        from grpc_health.v1 import health_pb2_grpc

        from radixmesh.common import tls
        from radixmesh.common.grpc_server import RECONNECT_OPTIONS

        self.channel = tls.aio_channel(address, options=RECONNECT_OPTIONS)
        self.stub = health_pb2_grpc.HealthStub(self.channel)

    async def check(self) -> tuple[bool, str]:
        from radixmesh.common.grpc_server import check_peer_health

        return await check_peer_health(self.stub, DEPENDENCY_CHECK_S)

    async def close(self) -> None:
        await self.channel.close()
