"""Run a worker: start the scheduler process, serve WorkerService until SIGTERM, drain, stop.

The scheduler runs in its own process (EngineClient); this process is only the asyncio gRPC
front end, so request I/O never shares the GIL with the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys

from radixmesh.common.grpc_server import GrpcServer, GrpcServerConfig
from radixmesh.engine.client import EngineClient
from radixmesh.engine.config import EngineConfig
from radixmesh.protocol import worker_pb2_grpc
from radixmesh.worker.config import WorkerConfig
from radixmesh.worker.service import SERVICE_NAME, WorkerServicer

logger = logging.getLogger(__name__)
ENGINE_WATCH_S = 1.0


async def serve_worker(server_config: GrpcServerConfig, config: WorkerConfig, engine_config: EngineConfig) -> int:
    print(f"radixmesh worker: loading {engine_config.model or 'the default model'} ...", file=sys.stderr, flush=True)
    client = await EngineClient.start(engine_config)
    try:
        server = GrpcServer(server_config, "worker", [SERVICE_NAME])
        servicer = WorkerServicer(client, config)
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server.server)
        await server.start()
        servicer.config = config = config.resolve(server.address)
        await attach_kv_events(client, config)
        watcher = asyncio.create_task(_watch_engine(client, server))
        await server.run_until_signal()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        return 0
    finally:
        await client.shutdown()


async def attach_kv_events(client: EngineClient, config: WorkerConfig) -> None:
    """Hook for the KV-cache index: publish the scheduler's block events (stored / removed / cleared)
    under this worker's lease. The scheduler sends them when EngineConfig.kv_events_block_size > 0;
    they arrive through `client.on_kv_events`. With no --redis-url nothing is published."""
    if config.redis_url is None:
        return
    logger.warning("worker %s: --redis-url given, but KV-event publishing is not wired in yet", config.worker_id)


async def _watch_engine(client: EngineClient, server: GrpcServer) -> None:
    """Report NOT_SERVING once the scheduler process died, so routers stop sending here."""
    while client.is_alive:
        await asyncio.sleep(ENGINE_WATCH_S)
    logger.error("the scheduler process is gone; reporting NOT_SERVING")
    await server.set_serving(False)
