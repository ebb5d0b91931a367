"""OpenTelemetry tracing of every radixmesh service: off unless an OTLP endpoint is configured.

    tracing.add_tracing_args(parser)                     # --otlp-endpoint
    tracing.configure("router", args.otlp_endpoint)      # before servers and channels are built
    server = grpc.aio.server(interceptors=tracing.server_interceptors())
    channel = grpc.aio.insecure_channel(addr, interceptors=tracing.client_interceptors())

Off (the default) nothing of the SDK or the exporter is imported, no provider is installed
(the global one stays the API's proxy, whose tracers hand out non-recording spans), servers
and channels get no interceptors, and `enabled()` is False so callers can skip building
span attributes. On, spans go to an OTLP/gRPC endpoint through a batch processor; the
standard variables apply: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT/HEADERS/TIMEOUT,
OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER[_ARG], OTEL_BSP_*,
OTEL_PROPAGATORS (W3C traceparent by default), OTEL_SDK_DISABLED.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the API is imported on first use: the CLI must start fast
    from opentelemetry.trace import Span, Tracer

logger = logging.getLogger(__name__)
TRACER_NAME = "radixmesh"
ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
UNTRACED_RPCS = ("grpc.health.v1.Health", "grpc.reflection.")
"""gRPC services whose calls get no spans (probes every second would each be a trace)."""
UNTRACED_METHODS = ("GetLoad",)
"""Methods of our own services that are probes, not requests."""

_provider: Any = None
_config: TracingConfig | None = None


@dataclass(frozen=True)
class TracingConfig:
    """Where this process sends its spans, resolved from the flag and the OTEL_* variables."""

    service: str
    """radixmesh service: gateway | tokenizer | router | worker | grammar | serve."""
    endpoint: str | None = None
    """OTLP/gRPC endpoint (http://host:4317); None: tracing off."""
    attributes: tuple[tuple[str, str], ...] = ()
    """Extra resource attributes (a worker's role)."""

    @property
    def service_name(self) -> str:
        """The resource's service.name: $OTEL_SERVICE_NAME, else radixmesh-<service>."""
        return os.environ.get("OTEL_SERVICE_NAME") or f"radixmesh-{self.service}"

    @classmethod
    def resolve(cls, service: str, endpoint: str | None = None,
                attributes: Mapping[str, str] | None = None) -> TracingConfig:
        """The flag wins over the variables; OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none turn it off."""
        if endpoint is None:
            endpoint = next((os.environ[name] for name in ENDPOINT_ENV if os.environ.get(name)), None)
        disabled = os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true" \
            or os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower() == "none"
        if disabled or not endpoint:
            endpoint = None
        elif "://" not in endpoint:
            endpoint = f"http://{endpoint}"  # host:port means plaintext gRPC, as a collector in the cluster
        return cls(service, endpoint, tuple(sorted((attributes or {}).items())))


def add_tracing_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--otlp-endpoint", default=None,
                        help="send OpenTelemetry traces to this OTLP/gRPC endpoint (host:port or http[s]://host:port; "
                             "default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT; "
                             "none: tracing off)")


def configure(service: str, endpoint: str | None = None, attributes: Mapping[str, str] | None = None) -> bool:
    """Install the SDK provider and the OTLP exporter when an endpoint is configured; True if tracing is on.

    Call once per process, before building gRPC servers and channels (they take their
    interceptors then). Spans still queued are flushed at exit.
    """
    global _provider, _config
    config = TracingConfig.resolve(service, endpoint, attributes)
    _config = config
    if config.endpoint is None or _provider is not None:
        return _provider is not None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource_attrs: dict[str, str] = {"service.namespace": "radixmesh", "radixmesh.service": service,
                                      **dict(config.attributes)}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        resource_attrs["service.name"] = config.service_name
    provider = TracerProvider(resource=Resource.create(resource_attrs))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint)))
    from opentelemetry import trace

    trace.set_tracer_provider(provider)
    _provider = provider
    atexit.register(shutdown)
    logger.info("tracing on: %s exports to %s", config.service_name, config.endpoint)
    return True


def enabled() -> bool:
    """Whether this process records spans (False: every tracing call is a no-op)."""
    return _provider is not None


def shutdown() -> None:
    """Flush and stop the exporter (idempotent; also runs at exit)."""
    global _provider
    provider, _provider = _provider, None
    if provider is not None:
        provider.shutdown()


def tracer() -> Tracer:
    """radixmesh's tracer: the SDK's when tracing is on, else the API's no-op proxy."""
    from opentelemetry import trace

    return trace.get_tracer(TRACER_NAME)


def span(name: str, attributes: Mapping[str, Any] | None = None) -> AbstractContextManager[Span | None]:
    """`with tracing.span("router.route") as span:` the current span's child, made current; with tracing
    off a shared null context yielding None (no OpenTelemetry call at all), so guard attribute work on it."""
    if not enabled():
        return _NULL_SPAN
    return tracer().start_as_current_span(name, attributes=dict(attributes or {}))


_NULL_SPAN: AbstractContextManager[None] = contextlib.nullcontext()


def set_attributes(attributes: Mapping[str, Any]) -> None:
    """Add attributes to the current span (an RPC's server span, the HTTP span); no-op when off."""
    if not enabled():
        return
    from opentelemetry import trace

    trace.get_current_span().set_attributes(dict(attributes))


def add_event(name: str, attributes: Mapping[str, Any] | None = None) -> None:
    """An event on the current span (a migration on the router's Generate span); no-op when off."""
    if not enabled():
        return
    from opentelemetry import trace

    trace.get_current_span().add_event(name, dict(attributes or {}))


def _rpc_filter() -> Any:
    from opentelemetry.instrumentation.grpc import filters

    skipped = [filters.service_prefix(prefix) for prefix in UNTRACED_RPCS]
    skipped += [filters.method_name(name) for name in UNTRACED_METHODS]
    return filters.negate(filters.any_of(*skipped))


def server_interceptors() -> list[Any]:
    """Interceptors of an asyncio gRPC server: extract the caller's context, one SERVER span per call."""
    if not enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(filter_=_rpc_filter())]


def client_interceptors() -> list[Any] | None:
    """Interceptors of an asyncio channel (None when off): one CLIENT span per call, context in the metadata."""
    if not enabled():
        return None
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(filter_=_rpc_filter()))


def instrument_channel(channel: Any) -> Any:
    """A blocking channel with the client interceptor when tracing is on; the channel itself when off."""
    if not enabled():
        return channel
    from opentelemetry.instrumentation.grpc import client_interceptor, intercept_channel

    return intercept_channel(channel, client_interceptor(filter_=_rpc_filter()))


def start_client_span(name: str) -> tuple[Span | None, dict[str, str]]:
    """For a transport without interceptors (the lane): a CLIENT span, child of the current one, that the
    caller ends, and the headers (W3C traceparent) that carry it to the server; (None, {}) when off."""
    if not enabled():
        return None, {}
    from opentelemetry import propagate, trace

    span = tracer().start_span(name, kind=trace.SpanKind.CLIENT, attributes={"rpc.system": "radixmesh-lane"})
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return span, carrier


def server_span_from(name: str, headers: Mapping[str, str]) -> AbstractContextManager[Span | None]:
    """A SERVER span child of the caller's context in `headers` (what the gRPC server interceptor makes of
    metadata), made current; the shared null context when tracing is off."""
    if not enabled():
        return _NULL_SPAN
    from opentelemetry import propagate, trace

    return tracer().start_as_current_span(name, context=propagate.extract(dict(headers)),
                                          kind=trace.SpanKind.SERVER, attributes={"rpc.system": "radixmesh-lane"})


def epoch_ns(wall_s: float | None = None) -> int:
    """A span timestamp: now, or a wall-clock time in seconds (time.time() of any local process)."""
    return time.time_ns() if wall_s is None else int(wall_s * 1e9)


def record_span(name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any] | None = None,
                parent: Span | None = None) -> None:
    """A finished span with explicit times, child of `parent` (default: the current span); no-op when off.

    For work timed elsewhere (the scheduler process sends timestamps): nothing is traced there.
    """
    if not enabled():
        return
    from opentelemetry import trace

    context = trace.set_span_in_context(parent) if parent is not None else None
    span = tracer().start_span(name, context=context, start_time=start_ns, attributes=dict(attributes or {}))
    span.end(end_time=max(end_ns, start_ns))
