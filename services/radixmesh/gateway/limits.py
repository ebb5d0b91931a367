"""Request-size limit of the HTTP gateway: bodies over the limit get 413 before any route parses them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixmesh.common.errors import invalid_argument
from radixmesh.gateway.errors import request_too_large_response

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on what one HTTP request may carry."""

    max_request_bytes: int = 4 << 20
    """Largest request body in bytes (4 MiB: a full context of token ids several times over)."""

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1024:
            raise invalid_argument("max_request_bytes must be >= 1024", "max_request_bytes")


class BodySizeLimitMiddleware:
    """Refuses bodies over `limits.max_request_bytes` with 413: at once when Content-Length says so,
    otherwise as soon as the streamed body passes the limit. Bodies within it are handed on unchanged.
    A client that goes away before its whole body arrived is no error: one info line, `on_client_gone`
    (the metric), and no route runs."""

    def __init__(self, app: ASGIApp, limits: RequestLimits | None = None,
                 on_client_gone: Callable[[], None] | None = None) -> None:
        self.app = app
        self.max_bytes = (limits or RequestLimits()).max_request_bytes
        self.on_client_gone = on_client_gone

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await request_too_large_response(self.max_bytes)(scope, receive, send)
            return
        messages = await self._read_body(receive)
        if messages is None:
            await request_too_large_response(self.max_bytes)(scope, receive, send)
            return
        if messages[-1]["type"] == "http.disconnect":
            client_gone(scope, sum(len(m.get("body", b"")) for m in messages), self.on_client_gone)
            return
        await self.app(scope, _replay(messages, receive), send)

    async def _read_body(self, receive: Receive) -> list[Message] | None:
        """The body's messages, or None once they pass the limit (a disconnect ends the list)."""
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return None
            if not message.get("more_body", False):
                return messages


def client_gone(scope: Scope, num_bytes: int | None = None, count: Callable[[], None] | None = None) -> None:
    """Log (one info line) and count a client that disconnected before its request was whole."""
    client = scope.get("client") or ("?", 0)
    got = f" after {num_bytes} bytes of its body" if num_bytes is not None else ""
    logger.info("%s %s: the client (%s:%s) went away%s; nothing to answer", scope.get("method", "?"),
                scope.get("path", "?"), client[0], client[1], got)
    if count is not None:
        count()


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A `receive` that hands out the already read messages first, then the real ones (disconnects)."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
