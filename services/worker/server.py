"""Run a worker: start the scheduler process, serve WorkerService until SIGTERM, drain, stop.

The scheduler runs in its own process (EngineClient); this process is only the asyncio gRPC
front end, so request I/O never shares the GIL with the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
from typing import TYPE_CHECKING

from radixmesh.common.grpc_server import GrpcServer, GrpcServerConfig
from radixmesh.engine.client import EngineClient
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.disagg.transport.registry import check_transport_device
from radixmesh.protocol import worker_pb2_grpc
from radixmesh.worker import metrics
from radixmesh.worker.config import WorkerConfig
from radixmesh.worker.service import SERVICE_NAME, WorkerServicer

if TYPE_CHECKING:
    from radixmesh.index.writer import KVIndexWriter

logger = logging.getLogger(__name__)
ENGINE_WATCH_S = 1.0


async def serve_worker(server_config: GrpcServerConfig, config: WorkerConfig, engine_config: EngineConfig) -> int:
    print(f"radixmesh worker: loading {engine_config.model or 'the default model'} ...", file=sys.stderr, flush=True)
    if config.redis_url is not None:
        engine_config = dataclasses.replace(engine_config, kv_events_block_size=config.block_size)
    if config.role != "unified":
        check_transport_device(config.kv_transport, engine_config.resolve().device)
    client = await EngineClient.start(engine_config)
    publisher, servicer = None, None
    try:
        server = GrpcServer(server_config, "worker", [SERVICE_NAME], {"radixmesh.role": config.role})
        servicer = WorkerServicer(client, config)
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server.server)
        await server.start()
        config = servicer.resolve(server.address)
        publisher = await attach_kv_events(client, config, server.metrics_port or 0)
        watcher = asyncio.create_task(_watch_engine(client, server))
        stats = metrics.start_worker_metrics(client.get_server_info, servicer.load, config.role, config.worker_id)
        await server.run_until_signal()
        for task in (watcher, stats):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return 0
    finally:
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
    await server.set_serving(False)
