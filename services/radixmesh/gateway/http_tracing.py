"""The gateway's HTTP span: the root of a request's trace, or the child of the client's `traceparent`.

Installed only when tracing is on (`create_app` checks), so with tracing off the HTTP path has
no tracing code at all. Pure ASGI: a streamed response stays inside the span until its last byte.
"""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry import propagate
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixmesh.common import tracing


class _HeaderGetter(Getter[dict[str, str]]):
    def get(self, carrier: dict[str, str], key: str) -> list[str] | None:
        value = carrier.get(key.lower())
        return None if value is None else [value]

    def keys(self, carrier: dict[str, str]) -> list[str]:
        return list(carrier)


_GETTER = _HeaderGetter()


def _headers(scope: Scope) -> dict[str, str]:
    raw: Iterable[tuple[bytes, bytes]] = scope.get("headers", ())
    return {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in raw}


class HttpTracingMiddleware:
    """One SERVER span per HTTP request, named `METHOD route`; W3C trace context read from the headers."""

    def __init__(self, app: ASGIApp, routes: frozenset[str], untraced: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.routes = routes
        self.untraced = untraced
        """Paths served without a span: probes and scrapes (each would be a trace of its own)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.untraced:
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"
        headers = _headers(scope)
        parent = propagate.extract(headers, getter=_GETTER)
        attributes = {"http.request.method": scope["method"], "http.route": route, "url.path": scope["path"],
                      "url.scheme": scope.get("scheme", "http")}
        if "user-agent" in headers:
            attributes["user_agent.original"] = headers["user-agent"]
        with tracing.tracer().start_as_current_span(f"{scope['method']} {route}", context=parent,
                                                    kind=SpanKind.SERVER, attributes=attributes) as span:

            async def send_and_record(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, send_and_record)

