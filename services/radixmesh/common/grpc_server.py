"""What every radixmesh gRPC service shares: flags, an asyncio server with grpc.health.v1 and
reflection, a Prometheus port, and draining on SIGTERM.

    server = GrpcServer(GrpcServerConfig(...), "tokenizer", [TOKENIZER_SERVICE_NAME])
    add_TokenizerServiceServicer_to_server(servicer, server.server)
    await server.start()
    await server.run_until_signal()   # SIGTERM/SIGINT: NOT_SERVING, refuse new calls, finish open ones

Health: the service names ("" and each servicer's) are SERVING while `server.readiness` is ready
(every required dependency up) and NOT_SERVING otherwise, with the reason in the trailing metadata
key `radixmesh-not-ready` of the Check reply. The service name `liveness` is SERVING for as long as
the process serves at all (Kubernetes liveness probes), whatever its dependencies do.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
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
from radixmesh.common.gc_tuning import freeze_startup_objects
from radixmesh.common.lane import LaneMethod, LaneServer
from radixmesh.common.readiness import Readiness
from radixmesh.common.tls import TlsConfig, add_tls_args, configure_clients, tls_config_from_args

logger = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
LIVENESS_SERVICE = "liveness"
"""Health service name that is SERVING while the process serves (readiness aside)."""
STREAMS_DRAINED_GRACE_S = 1.0
"""Grace of the server's stop once a service drained its own streams (health watches and control calls)."""
NOT_READY_METADATA_KEY = "radixmesh-not-ready"
"""Trailing metadata of a NOT_SERVING Check reply: why the service is not ready."""
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 2_000)]
"""Channel options of clients of another radixmesh service: a peer that comes back is found again within
about two seconds (gRPC's default reconnect backoff grows to two minutes)."""


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
    tls: TlsConfig | None = None
    """TLS of the port and mutual TLS with other services (None: plaintext)."""
    health_port: int | None = None
    """A plaintext port serving only grpc.health.v1, for probes that cannot speak TLS (the kubelet's); None: none."""
    lane_port: int = 0
    """Port of the Generate lane (services that register one: worker, router); 0 picks a free one, -1: none.
    Never opened with TLS (the lane is plaintext; Generate stays on the gRPC port)."""

    def __post_init__(self) -> None:
        if not -1 <= self.lane_port <= 65535:
            raise invalid_argument(f"lane_port must be in [-1, 65535] (got {self.lane_port})", "lane_port")
        if not 0 <= self.port <= 65535:
            raise invalid_argument(f"port must be in [0, 65535] (got {self.port})", "port")
        if self.health_port is not None and not 0 <= self.health_port <= 65535:
            raise invalid_argument(f"health_port must be in [0, 65535] (got {self.health_port})", "health_port")
        if not -1 <= self.metrics_port <= 65535:
            raise invalid_argument(f"metrics_port must be in [-1, 65535] (got {self.metrics_port})", "metrics_port")
        if self.drain_timeout_s < 0:
            raise invalid_argument("drain_timeout_s must be >= 0", "drain_timeout_s")


def add_server_args(parser: argparse.ArgumentParser, default_port: int, log_level: bool = True,
                    lane: bool = False) -> None:
    """The flags every gRPC service takes (log_level=False where the engine flags already add it; lane=True:
    the service serves Generate on a lane too)."""
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=default_port, help="gRPC port (0 picks a free one)")
    if lane:
        parser.add_argument("--lane-port", type=int, default=0,
                            help="port of the Generate lane: the same Generate as the gRPC port over plain TCP, "
                                 "~1 ms less per hop; peers learn it from GetLoad (0 picks a free one, -1: no lane; "
                                 "never with TLS)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="Prometheus HTTP port (0 picks a free one, -1 turns metrics off)")
    parser.add_argument("--redis-url", default=env_str("REDIS_URL"),
                        help="Redis of the KV-cache index and worker leases (default: $RADIXMESH_REDIS_URL; none: off)")
    parser.add_argument("--drain-timeout-s", type=float, default=30.0,
                        help="on SIGTERM, seconds in-flight calls may finish before they are cancelled")
    parser.add_argument("--health-port", type=int, default=None,
                        help="also serve grpc.health.v1 alone, in plaintext, on this port (for kubelet probes when "
                             "the gRPC port needs mutual TLS; 0 picks a free one)")
    tracing.add_tracing_args(parser)
    add_tls_args(parser)
    if log_level:
        parser.add_argument("--log-level", default="warning", help="logging level")


def server_config(args: argparse.Namespace) -> GrpcServerConfig:
    """The server config of a service's flags; with TLS flags, also how the process dials other services
    (set now: a worker spawns its scheduler, which calls the grammar service, before its server exists)."""
    tls = tls_config_from_args(args)
    if tls is not None:
        configure_clients(tls)
    return GrpcServerConfig(host=args.host, port=args.port, metrics_port=args.metrics_port,
                            drain_timeout_s=args.drain_timeout_s, otlp_endpoint=args.otlp_endpoint,
                            tls=tls, health_port=args.health_port, lane_port=getattr(args, "lane_port", -1))


def setup_logging(level: str, service: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {service} %(name)s %(levelname)s %(message)s")


class ReadinessHealthServicer(HealthServicer):
    """grpc.health.v1 that explains NOT_SERVING: the readiness reason goes in the reply's trailing metadata."""

    def __init__(self, readiness: Readiness) -> None:
        super().__init__()
        self.readiness = readiness

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> Any:
        reply = await super().Check(request, context)
        if reply is not None and reply.status != health_pb2.HealthCheckResponse.SERVING:
            reason = self.readiness.reason or "shutting down"
            context.set_trailing_metadata(((NOT_READY_METADATA_KEY, _ascii(reason)),))
        return reply


async def check_peer_health(stub: health_pb2_grpc.HealthStub, timeout_s: float, service: str = "") -> tuple[bool, str]:
    """(up, detail) of another service by its grpc.health.v1: up when SERVING; otherwise why not (its own
    not-ready reason when it is a radixmesh service)."""
    call = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    try:
        reply = await call
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return False, f"not reachable: {_first_line(exc.details() or code.name.lower())}"
        return False, f"health check failed: {code.name if code else exc}"
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return True, ""
    reason = next((str(v) for k, v in (await call.trailing_metadata() or ()) if k == NOT_READY_METADATA_KEY), "")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return False, f"{status}: {reason}" if reason else status


def _first_line(text: str) -> str:
    """gRPC's connect failure, short: "failed to connect to all addresses; last error: ...: Connection refused"
    becomes "connection refused"."""
    text = text.strip().splitlines()[0] if text.strip() else text
    if "last error" in text:
        text = text.rsplit(": ", 1)[-1].lower()
    return text[:200]


def _ascii(text: str) -> str:
    return text.encode("ascii", "replace").decode()[:1000]


class GrpcServer:
    """One asyncio gRPC server: the service's own servicers plus health and reflection.

    `readiness` holds the service's dependencies; declare them (`readiness.add`) and report their
    states (`readiness.set`) from anywhere on the event loop: the health status follows.
    """

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
        if config.tls is not None:
            configure_clients(config.tls)  # before any channel to another service is built
        self.server = grpc.aio.server(options=options, interceptors=tracing.server_interceptors())
        self.readiness = Readiness(name)
        self.health = ReadinessHealthServicer(self.readiness)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], self.server)
        self.port = 0
        self.health_port: int | None = None
        self._health_server: grpc.aio.Server | None = None
        self.metrics_port: int | None = None
        self._metrics_httpd: Any = None
        self._lane_methods: dict[str, LaneMethod] = {}
        self.lane: LaneServer | None = None
        self._stop = asyncio.Event()
        self._started = False
        self._health_tasks: set[asyncio.Task[None]] = set()
        self.readiness.on_change(self._on_readiness)

    def add_lane(self, methods: Mapping[str, LaneMethod]) -> None:
        """Serve these streaming methods on the lane too (before `start`)."""
        self._lane_methods.update(methods)

    @property
    def lane_port(self) -> int:
        """The lane's port once started; 0 when this server has none."""
        return self.lane.port if self.lane is not None else 0

    @property
    def address(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"{host}:{self.port}"

    async def start(self) -> None:
        """Bind, start serving, report health (SERVING once ready), print where it listens."""
        tls = self.config.tls
        try:
            if tls is not None and tls.serves_tls:
                credentials = tls.server_credentials(require_client_cert=tls.mutual)
                self.port = self.server.add_secure_port(f"{self.config.host}:{self.config.port}", credentials)
            else:
                self.port = self.server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        except RuntimeError as exc:
            raise invalid_argument(f"cannot listen on {self.config.host}:{self.config.port}: {exc}", "port") from None
        self._start_metrics()
        await self.server.start()
        await self._start_health_port()
        await self._start_lane()
        self._started = True
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self.set_serving(self.readiness.ready)
        metrics = f", metrics on :{self.metrics_port}" if self.metrics_port is not None else ""
        metrics += f", health on :{self.health_port}" if self.health_port is not None else ""
        metrics += f", Generate lane on :{self.lane_port}" if self.lane is not None else ""
        security = ""
        if tls is not None and tls.serves_tls:
            security = " (mutual TLS)" if tls.mutual else " (TLS)"
        waiting = "" if self.readiness.ready else f" (not ready: {self.readiness.reason})"
        print(f"radixmesh {self.name}: listening on {self.address}{security}{metrics}{waiting}", flush=True)

    async def _start_health_port(self) -> None:
        """grpc.health.v1 alone on a plaintext port (the same statuses as the main port's)."""
        if self.config.health_port is None:
            return
        self._health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
        try:
            self.health_port = self._health_server.add_insecure_port(f"{self.config.host}:{self.config.health_port}")
        except RuntimeError as exc:
            raise invalid_argument(f"cannot listen on {self.config.host}:{self.config.health_port}: {exc}",
                                   "health_port") from None
        await self._health_server.start()

    async def _start_lane(self) -> None:
        tls = self.config.tls
        if not self._lane_methods or self.config.lane_port < 0:
            return
        if tls is not None and tls.serves_tls:
            logger.info("%s: no Generate lane with TLS (Generate stays on the gRPC port)", self.name)
            return
        self.lane = LaneServer(self._lane_methods, self.name)
        try:
            await self.lane.start(self.config.host, self.config.lane_port)
        except OSError as exc:
            self.lane = None
            raise invalid_argument(f"cannot listen on {self.config.host}:{self.config.lane_port}: {exc}",
                                   "lane_port") from None

    def _start_metrics(self) -> None:
        if self.config.metrics_port < 0:
            return
        from prometheus_client import start_http_server

        from radixmesh.common.metrics import LabelledRegistry, set_process_labels

        set_process_labels(service=self.name)  # every series carries service="<name>" (workers add role, worker)
        self._metrics_httpd, _ = start_http_server(self.config.metrics_port, addr=self.config.host,
                                                   registry=LabelledRegistry())
        self.metrics_port = int(self._metrics_httpd.server_port)

    def _on_readiness(self, readiness: Readiness) -> None:
        if not self._started:
            return  # start() reports the state it finds
        task = asyncio.get_running_loop().create_task(self._sync_health())
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def _sync_health(self) -> None:
        await self.set_serving(self.readiness.ready)  # the state when this runs: tasks never apply stale ones

    async def set_serving(self, serving: bool) -> None:
        """Set the health of "" and every servicer (readiness does this by itself; `liveness` is untouched)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", *self.service_names):
            await self.health.set(service, status)

    def request_stop(self) -> None:
        """Start draining (what SIGTERM does); a second request cancels in-flight calls at once."""
        if self._stop.is_set():
            logger.warning("%s: stop requested again; cancelling in-flight calls", self.name)
            asyncio.get_running_loop().create_task(self.server.stop(0))
            if self.lane is not None:
                asyncio.get_running_loop().create_task(self.lane.close(0))
        self._stop.set()

    async def run_until_signal(self, drain_streams: Callable[[], Awaitable[object]] | None = None) -> None:
        """Serve until SIGTERM/SIGINT (or `request_stop`), then drain. `drain_streams`: the service drains its own
        streams first (health is NOT_SERVING by then; see radixmesh.common.drain), and the server then stops
        with a short grace (what is left are health watches)."""
        freeze_startup_objects()  # the service is built: keep the collector off what startup made
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)
        try:
            await self._stop.wait()
            if drain_streams is None:
                await self.drain()
            else:
                await self.health.enter_graceful_shutdown()  # watchers (routers) hear NOT_SERVING now
                await drain_streams()
                await self.drain(grace_s=STREAMS_DRAINED_GRACE_S)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    async def stop(self, grace_s: float = 0.0) -> None:
        """Stop serving the gRPC port and the lane (no health hand-off, unlike `drain`): a process that dies."""
        if self.lane is not None:
            await asyncio.gather(self.server.stop(grace_s), self.lane.close(grace_s))
        else:
            await self.server.stop(grace_s)

    async def drain(self, grace_s: float | None = None) -> None:
        """Report NOT_SERVING, refuse new calls, let open ones finish within `grace_s` (default drain_timeout_s)."""
        grace_s = self.config.drain_timeout_s if grace_s is None else grace_s
        logger.info("%s: draining (up to %.0f s)", self.name, grace_s)
        await self.health.enter_graceful_shutdown()
        await self.stop(grace_s)
        if self._health_server is not None:
            await self._health_server.stop(0)
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd = None
        print(f"radixmesh {self.name}: stopped", flush=True)
