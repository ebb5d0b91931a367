"""The FastAPI application: routes, the API-key check, per-route metrics and error bodies."""

from __future__ import annotations

import inspect
import logging
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixmesh import __version__
from radixmesh.common import tracing
from radixmesh.common.errors import ErrorCode, RadixMeshError, invalid_argument
from radixmesh.gateway import lora_api, native_api, openai_api, request_trace, responses_api, tokenize_api
from radixmesh.gateway.auth import ApiKeys, api_keys_of
from radixmesh.gateway.backend import GatewayBackend
from radixmesh.gateway.cluster_backend import ClusterBackend
from radixmesh.gateway.config import GatewayConfig
from radixmesh.gateway.dispatch import Dispatcher
from radixmesh.gateway.errors import CLIENT_CLOSED_REQUEST, error_response, framework_error_response, to_http
from radixmesh.gateway.limits import BodySizeLimitMiddleware, client_gone
from radixmesh.gateway.metrics import GatewayMetrics
from radixmesh.gateway.state import GatewayState, get_state
from radixmesh.gateway.upstreams import not_ready_error

logger = logging.getLogger(__name__)
LIVENESS_PATHS = frozenset({"/live", "/health/live"})
"""200 while the process serves HTTP, whatever its dependencies do (Kubernetes liveness)."""
READINESS_PATHS = frozenset({"/ready", "/health/ready"})
"""Like /health (200 when ready, else 503 naming what is missing), with the dependencies' states as JSON."""
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics", *LIVENESS_PATHS, *READINESS_PATHS})
"""Paths served without the API key: probes and Prometheus scrapes."""
UNGATED_PATHS = frozenset({"/metrics", "/version", "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect",
                           *LIVENESS_PATHS, *READINESS_PATHS})
"""Paths answered while the backend is not ready; every other one gets 503 naming what is missing."""


def create_app(backend: GatewayBackend, config: GatewayConfig, api_keys: ApiKeys | None = None,
               service: str | None = None) -> FastAPI:
    """The gateway over `backend`; the caller owns the backend's lifetime. The backend may not be ready yet
    (a gateway whose router is not up): the app serves at once and answers 503 until it is. `api_keys`:
    the keys (shared with the gRPC API), by default those of `config`; `service`: the metrics' service label
    (default: gateway over a remote backend, serve over a local engine)."""
    service = service or ("gateway" if isinstance(backend, ClusterBackend) else "serve")
    metrics = GatewayMetrics(config.served_model_name or "", service)
    backend.when_card_known(lambda card: metrics.set_model_name(card.name))
    state = GatewayState(backend, config, metrics, Dispatcher(backend, metrics, config.max_queued_requests))
    if metrics.queue_time is not None:
        backend.bind_queue_time(metrics.queue_time)
    for collector, view_service in backend.metric_views():
        metrics.add_view(collector, view_service)
    app = FastAPI(title="radixmesh", version=__version__,
                  description="OpenAI-compatible and SGLang-native LLM serving API", **_no_native_telemetry())
    app.state.gateway = state
    routers = (probes, openai_api.router, responses_api.router, native_api.router, tokenize_api.router,
               lora_api.router)
    for router in routers:
        app.include_router(router)
    _add_exception_handlers(app)
    app.add_middleware(ReadinessGateMiddleware, backend=backend)
    keys = api_keys or api_keys_of(config)
    if keys is not None:
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    routes = frozenset(getattr(route, "path", "") for router in routers
                       for route in router.routes)
    app.add_middleware(BodySizeLimitMiddleware,  # 413 for bodies over RequestLimits.max_request_bytes
                       on_client_gone=lambda: metrics.observe_client_gone("http"))
    app.add_middleware(RouteMetricsMiddleware, metrics=metrics, routes=routes)
    if tracing.enabled():
        from radixmesh.gateway.http_tracing import HttpTracingMiddleware

        # outermost: the span covers everything; probes and scrapes get none
        app.add_middleware(HttpTracingMiddleware, routes=routes, untraced=OPEN_PATHS - {"/health_generate"})
    trace_out = request_trace.trace_file()
    if trace_out is not None:  # outermost: the timeline starts before any other middleware runs
        app.add_middleware(request_trace.RequestTraceMiddleware, out=trace_out)
    return app


probes = APIRouter(tags=["probes"])


@probes.get("/live")
@probes.get("/health/live")
async def live() -> Response:
    """Liveness: the process serves. Never depends on the router, tokenizer or workers."""
    return JSONResponse({"status": "alive"})


@probes.get("/ready")
@probes.get("/health/ready")
async def ready(request: Request) -> Response:
    """Readiness with details: 200 and the dependencies when ready; else 503, the reason and the same details."""
    details = get_state(request).backend.readiness_details()
    if details["ready"]:
        return JSONResponse({"status": "ready", **details})
    status, body = to_http(not_ready_error(details["reason"]))
    return JSONResponse({**body, **details}, status_code=status)


class ReadinessGateMiddleware:
    """Until the backend is ready, every path but `UNGATED_PATHS` gets 503 with an OpenAI error body that names
    the missing dependency (/health included: readiness as SGLang users expect it)."""

    def __init__(self, app: ASGIApp, backend: GatewayBackend) -> None:
        self.app = app
        self.backend = backend

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in UNGATED_PATHS:
            reason = self.backend.not_ready_reason()
            if reason:
                await error_response(not_ready_error(reason))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _no_native_telemetry() -> dict[str, Any]:
    """FastAPI >= 0.16x traces by itself once a tracer provider is installed: a second HTTP span per request
    (and spans per dependency) beside ours. Ours is the one span per request; theirs is turned off."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}


def _add_exception_handlers(app: FastAPI) -> None:
    async def domain_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RadixMeshError)
        return error_response(exc)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path")]
        return error_response(invalid_argument(f"invalid request: {first.get('msg', exc)}",
                                                loc[0] if loc else None))

    async def framework_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return framework_error_response(exc.status_code, str(exc.detail))

    async def disconnected(request: Request, exc: Exception) -> Response:
        """A body read after the client left (routes that read one past the size limit's middleware)."""
        client_gone(request.scope, count=lambda: get_state(request).metrics.observe_client_gone("http"))
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(RadixMeshError(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"))

    app.add_exception_handler(RadixMeshError, domain_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, framework_error)
    app.add_exception_handler(ClientDisconnect, disconnected)
    app.add_exception_handler(Exception, internal_error)


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on every path but `OPEN_PATHS` (pure ASGI: streams untouched)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        exc = self.keys.check(dict(scope["headers"]).get(b"authorization"), "'Authorization: Bearer <key>'")
        if exc is None:
            await self.app(scope, receive, send)
            return
        await error_response(exc)(scope, receive, send)


class RouteMetricsMiddleware:
    """Counts responses by route and status; unknown paths count as one route so labels stay few."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, routes: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"
        status = 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.observe_http(route, status)
