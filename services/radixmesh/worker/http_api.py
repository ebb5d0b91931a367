"""A worker's OpenAI-compatible HTTP API (`radixmesh worker --http-port P`).

The same app as `radixmesh serve` (OpenAI and native routes, /health, /metrics), over this worker's own
scheduler process: the worker is then a model server an inference gateway can send requests to directly,
after the router, as the gateway's endpoint picker (`router --epp-port`), chose it by its cached prefix.
Its /metrics carries the model-server protocol's gauges (radixmesh.gateway.model_server_metrics). The worker
reports the port in GetLoad, so pickers learn where each worker's HTTP API is.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from radixmesh.common import aio
from radixmesh.engine.client import EngineClient
from radixmesh.gateway.app import create_app
from radixmesh.gateway.config import GatewayConfig
from radixmesh.gateway.local_backend import LocalEngineBackend
from radixmesh.gateway.server import bind_socket, http_server

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 30.0


class WorkerHttpApi:
    """uvicorn serving the HTTP app in the worker's event loop; the worker owns (and stops) the engine client."""

    def __init__(self, client: EngineClient, host: str, port: int, served_model_name: str | None = None,
                 graceful_shutdown_s: float = 5.0) -> None:
        self.config = GatewayConfig(host=host, port=port, served_model_name=served_model_name,
                                    graceful_shutdown_s=graceful_shutdown_s)
        self.backend = LocalEngineBackend(client, served_model_name)
        """Never closed here: closing it would stop the engine the gRPC service also runs on."""
        self.port = 0
        self._server = http_server(create_app(self.backend, self.config, service="worker"), self.config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Listen and serve; returns the bound port (the config's, or a free one for 0)."""
        sock = bind_socket(self.config.host, self.config.port)
        self.port = int(sock.getsockname()[1])
        self._task = asyncio.create_task(self._serve(sock), name="worker-http")
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while not self._server.started and not self._task.done():
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"the worker's HTTP API did not start on port {self.port}")
            await asyncio.sleep(0.02)
        if self._task.done():
            self._task.result()  # raises what stopped it
        print(f"radixmesh worker: OpenAI HTTP API on {self.config.url(self.port)}", flush=True)
        return self.port

    async def _serve(self, sock: socket.socket) -> None:
        try:
            await self._server.serve(sockets=[sock])
        finally:
            sock.close()

    async def stop(self) -> None:
        """Let open requests finish (up to graceful_shutdown_s), then stop listening."""
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await aio.wait_for(asyncio.shield(self._task), self.config.graceful_shutdown_s + 5)
        except asyncio.TimeoutError:
            logger.warning("worker HTTP API: open requests did not finish; stopping it")
            await aio.cancel_and_wait(self._task)
        self._task = None
