"""`radixmesh serve` and `radixmesh gateway`: bind, start the backend, serve HTTP with uvicorn, stop
everything on a signal.

The gateway's backend starts at once and connects in the background (it answers 503 until its
router and tokenizer do); `serve` loads the model before it serves.

The listening socket is bound first, so a busy port fails in a second rather than after the
model has loaded. SIGINT/SIGTERM stop the engine start, or let uvicorn drain open requests
for `graceful_shutdown_s`; the scheduler process is shut down last, in every case.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import uvicorn

from radixmesh.common.env import http_parser
from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.common.gc_tuning import freeze_startup_objects
from radixmesh.engine.config import EngineConfig
from radixmesh.gateway.app import create_app
from radixmesh.gateway.auth import api_keys_of
from radixmesh.gateway.backend import GatewayBackend
from radixmesh.gateway.config import GatewayConfig
from radixmesh.gateway.grpc_api_server import PublicGrpcServer
from radixmesh.gateway.local_backend import LocalEngineBackend
from radixmesh.gateway.state import GatewayState

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn, minus its own signal handling (`serve` installs handlers that also cover engine start)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound and listening. It names its protocol (TCP): asyncio turns Nagle's algorithm
    off only on connections whose socket says TCP, and with it on, a response's body (or a stream's first
    event) written after its headers waits for the client's delayed ACK, about 40 ms on Linux."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RadixMeshError(ErrorCode.UNAVAILABLE, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def serve(config: GatewayConfig, engine_config: EngineConfig) -> int:
    """`radixmesh serve`: the gateway over a local scheduler process, until SIGINT/SIGTERM."""
    return await serve_backend(config, lambda: LocalEngineBackend.start(engine_config, config.served_model_name,
                                                                        config.image_limits, config.tokenizer_workers),
                               f"loading {engine_config.model or 'the default model'}")


async def serve_backend(config: GatewayConfig, start_backend: Callable[[], Awaitable[GatewayBackend]],
                        starting: str) -> int:
    """Start a backend, serve HTTP (and the gRPC API) over it until SIGINT/SIGTERM; returns the exit code."""
    keys = api_keys_of(config)  # a bad key file fails now, not after the model loaded
    sock = bind_socket(config.host, config.port)
    port = sock.getsockname()[1]
    grpc_api = PublicGrpcServer(config, keys) if config.grpc_port is not None else None
    if grpc_api is not None:
        grpc_api.bind()
        await grpc_api.start()  # health NOT_SERVING, calls UNAVAILABLE, until the backend is up
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None
    server: _Server | None = None
    stopping: list[asyncio.Task[None]] = []

    def on_signal() -> None:
        if server is None:
            main_task.cancel()  # still starting the engine
        elif server.should_exit:
            server.force_exit = True
        else:
            server.should_exit = True
            if grpc_api is not None:
                stopping.append(loop.create_task(grpc_api.stop(config.graceful_shutdown_s)))
            # Requests still open at the deadline end with finish_reason "abort" rather than a reset.
            loop.call_later(config.graceful_shutdown_s, lambda: loop.create_task(state.dispatcher.abort_all()))

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    backend: GatewayBackend | None = None
    try:
        print(f"radixmesh: {starting} ...", file=sys.stderr, flush=True)
        backend = await start_backend()
        app = create_app(backend, config, keys)
        freeze_startup_objects()
        state: GatewayState = app.state.gateway
        if grpc_api is not None:
            grpc_api.attach(state)
        server = http_server(app, config)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if server.started:
            _print_started(backend, config.url(port), grpc_api)
        await serving
        return 0
    except asyncio.CancelledError:
        print("radixmesh: interrupted while starting", file=sys.stderr, flush=True)
        return 130
    finally:
        if grpc_api is not None:
            await (stopping[0] if stopping else grpc_api.stop(0))
        if backend is not None:
            await backend.close()
        sock.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def http_server(app: Any, config: GatewayConfig) -> _Server:
    """uvicorn over `app`, serving TLS when the gateway has a certificate; httptools parses the requests when
    installed (RADIXMESH_HTTP_PARSER)."""
    tls = config.tls if config.serves_tls else None
    return _Server(uvicorn.Config(app, log_level=config.log_level.lower(), lifespan="off", http=http_parser(),
                                  timeout_graceful_shutdown=round(config.graceful_shutdown_s) + 5,
                                  ssl_certfile=tls.cert_file if tls else None,
                                  ssl_keyfile=tls.key_file if tls else None))


def _print_started(backend: GatewayBackend, url: str, grpc_api: PublicGrpcServer | None) -> None:
    if grpc_api is not None:
        security = " (TLS)" if grpc_api.serves_tls else ""
        print(f"radixmesh: gRPC API (radixmesh.v1.InferenceService) on port {grpc_api.port}{security}", flush=True)
    reason = backend.not_ready_reason()
    if reason:  # a gateway whose dependencies are not up yet: it serves /live now and /health once they are
        print(f"radixmesh: listening at {url} (OpenAI API under /v1); not ready yet: {reason}", flush=True)
        return
    device = backend.card.extra.get("device", "?")
    print(f"radixmesh: serving {backend.card.name} on {device} at {url} (OpenAI API under /v1)", flush=True)
