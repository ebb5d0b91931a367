"""Server-sent events: `data: {json}\\n\\n` frames ending in `data: [DONE]\\n\\n`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from radixmesh.common.errors import RadixMeshError
from radixmesh.gateway.errors import error_event

DONE = "data: [DONE]\n\n"
logger = logging.getLogger(__name__)


def event(payload: BaseModel | str) -> str:
    """One SSE frame; a model is serialized as JSON (None fields kept, as OpenAI sends them)."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


async def with_error_events(events: AsyncIterator[str]) -> AsyncGenerator[str, None]:
    """Pass frames through; a domain error after the stream started becomes an error frame, then [DONE]."""
    try:
        async for frame in events:
            yield frame
    except RadixMeshError as exc:
        yield error_event(exc)
        yield DONE


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response that always runs `on_close` when it ends.

    The body iterator is closed, and `on_close` awaited, whether the stream completed, the
    client disconnected (Starlette cancels the send loop) or the server is shutting down, so
    an abandoned request is aborted in the engine and its KV freed.
    """

    def __init__(self, events: AsyncGenerator[str, None],
                 on_close: Callable[[], Awaitable[None]] | None = None, headers: dict[str, str] | None = None) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await _shielded(self._close())

    async def _close(self) -> None:
        try:
            await self._events.aclose()
        finally:
            if self._on_close is not None:
                await self._on_close()


async def _shielded(work: Awaitable[Any]) -> None:
    # Cleanup must finish even when the surrounding task is being cancelled again.
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await task
        raise
    except Exception:
        logger.exception("closing an event stream failed")
