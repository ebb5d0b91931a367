"""What every radixmesh gRPC service shares: flags, an asyncio server with grpc.health.v1 and
reflection, a Prometheus port, and draining on SIGTERM.

    server = GrpcServer(GrpcServerConfig(...), "tokenizer", [TOKENIZER_SERVICE_NAME])
    add_TokenizerServiceServicer_to_server(servicer, server.server)
    await server.start()
    await server.run_until_signal()   # SIGTERM/SIGINT: NOT_SERVING, refuse new calls, finish open ones
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from radixmesh.common import tracing
from radixmesh.common.env import env_str
from radixmesh.common.errors import invalid_argument

logger = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class GrpcServerConfig:
    """Where a gRPC service listens and how it stops."""

    host: str = "127.0.0.1"
    """Interface to listen on (the Helm chart passes 0.0.0.0)."""
    port: int = 0
    """gRPC port; 0 picks a free one (printed at start)."""
    metrics_port: int = 0
    """Prometheus HTTP port; 0 picks a free one, -1 turns metrics off."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight calls may run before they are cancelled."""
    max_message_bytes: int = MAX_MESSAGE_BYTES
    """Largest gRPC message sent or received."""
    otlp_endpoint: str | None = None
    """OTLP/gRPC endpoint of traces; None: $OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else tracing off."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise invalid_argument(f"port must be in [0, 65535] (got {self.port})", "port")
        if not -1 <= self.metrics_port <= 65535:
            raise invalid_argument(f"metrics_port must be in [-1, 65535] (got {self.metrics_port})", "metrics_port")
        if self.drain_timeout_s < 0:
            raise invalid_argument("drain_timeout_s must be >= 0", "drain_timeout_s")


def add_server_args(parser: argparse.ArgumentParser, default_port: int, log_level: bool = True) -> None:
    """The flags every gRPC service takes (log_level=False where the engine flags already add it)."""
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=default_port, help="gRPC port (0 picks a free one)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="Prometheus HTTP port (0 picks a free one, -1 turns metrics off)")
    parser.add_argument("--redis-url", default=env_str("REDIS_URL"),
                        help="Redis of the KV-cache index and worker leases (default: $RADIXMESH_REDIS_URL; none: off)")
    parser.add_argument("--drain-timeout-s", type=float, default=30.0,
                        help="on SIGTERM, seconds in-flight calls may finish before they are cancelled")
    tracing.add_tracing_args(parser)
    if log_level:
        parser.add_argument("--log-level", default="warning", help="logging level")


def server_config(args: argparse.Namespace) -> GrpcServerConfig:
    return GrpcServerConfig(host=args.host, port=args.port, metrics_port=args.metrics_port,
                            drain_timeout_s=args.drain_timeout_s, otlp_endpoint=args.otlp_endpoint)


def setup_logging(level: str, service: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {service} %(name)s %(levelname)s %(message)s")


class GrpcServer:
    """One asyncio gRPC server: the service's own servicers plus health and reflection."""

    def __init__(self, config: GrpcServerConfig, name: str, service_names: Sequence[str],
                 trace_attributes: Mapping[str, str] | None = None) -> None:
        """`trace_attributes`: extra resource attributes of this process's spans (a worker's role)."""
        self.config = config
        self.name = name
        self.service_names = list(service_names)
        options = [("grpc.max_send_message_length", config.max_message_bytes),
                   ("grpc.max_receive_message_length", config.max_message_bytes),
                   ("grpc.so_reuseport", 0)]
        tracing.configure(name, config.otlp_endpoint, trace_attributes)  # before the server: it takes the interceptors
        self.server = grpc.aio.server(options=options, interceptors=tracing.server_interceptors())
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], self.server)
        self.port = 0
        self.metrics_port: int | None = None
        self._metrics_httpd: Any = None
        self._stop = asyncio.Event()

    @property
    def address(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"{host}:{self.port}"

    async def start(self) -> None:
        """Bind, start serving, mark every service SERVING, print where it listens."""
        try:
            self.port = self.server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        except RuntimeError as exc:
            raise invalid_argument(f"cannot listen on {self.config.host}:{self.config.port}: {exc}", "port") from None
        self._start_metrics()
        await self.server.start()
        await self.set_serving(True)
        metrics = f", metrics on :{self.metrics_port}" if self.metrics_port is not None else ""
        print(f"radixmesh {self.name}: listening on {self.address}{metrics}", flush=True)

    def _start_metrics(self) -> None:
        if self.config.metrics_port < 0:
            return
        from prometheus_client import start_http_server

        from radixmesh.common.metrics import LabelledRegistry, set_process_labels

        set_process_labels(service=self.name)  # every series carries service="<name>" (workers add role, worker)
        self._metrics_httpd, _ = start_http_server(self.config.metrics_port, addr=self.config.host,
                                                   registry=LabelledRegistry())
        self.metrics_port = int(self._metrics_httpd.server_port)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", *self.service_names):
            await self.health.set(service, status)

    def request_stop(self) -> None:
        """Start draining (what SIGTERM does); a second request cancels in-flight calls at once."""
        if self._stop.is_set():
            logger.warning("%s: stop requested again; cancelling in-flight calls", self.name)
            asyncio.get_running_loop().create_task(self.server.stop(0))
        self._stop.set()

    async def run_until_signal(self) -> None:
        """Serve until SIGTERM/SIGINT (or `request_stop`), then drain."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)
        try:
            await self._stop.wait()
            await self.drain()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    async def drain(self) -> None:
        """Report NOT_SERVING, refuse new calls, let open ones finish within drain_timeout_s."""
        logger.info("%s: draining (up to %.0f s)", self.name, self.config.drain_timeout_s)
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.config.drain_timeout_s)
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd = None
        print(f"radixmesh {self.name}: stopped", flush=True)
