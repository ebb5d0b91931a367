"""A per-request timeline of an HTTP front end, for finding where a request's time to first token goes.

With `RADIXMESH_REQUEST_TRACE=PATH` set in the front end's environment (`{pid}` in it becomes the process id), each
HTTP request writes one JSON line to PATH when its response ends: its path, the engine request id and prompt
tokens of a generation, and host times (`time.perf_counter()`, seconds: the machine's monotonic clock, which the
scheduler's step trace (RADIXMESH_STEP_TRACE) and a benchmark client on the same host read too):

    t_http         the request reached the app (its headers parsed)
    t_body         its body was read
    t_open         admitted with its token ids (`tokenize_s` of the time before it was tokenization)
    t_submit       handed to the engine client (`serve`'s local engine: its message to the scheduler goes now)
    t_first_out    the engine's first output for it reached the front end (`serve`'s local engine)
    t_first_chunk  the first token's text came out of the detokenizer
    t_first_body   the first response bytes after the headers were handed to the HTTP server
    t_end          the response ended

`scripts/request_timeline.py` joins these lines with a step trace and a `bench serving` result file. Off unless
set: no records, and `mark` costs one context-variable read.
"""

from __future__ import annotations

import json
import os
import time
from contextvars import ContextVar
from typing import IO, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

ENV = "RADIXMESH_REQUEST_TRACE"

_record: ContextVar[dict[str, Any] | None] = ContextVar("radixmesh_request_trace", default=None)


def mark(name: str, at: float | None = None, **values: Any) -> None:
    """Note time `name` (now, or `at` on the same clock) and `values` on the current request's record; the first
    of each stays."""
    record = _record.get()
    if record is None:
        return
    if name not in record:
        record[name] = time.perf_counter() if at is None else at
    for key, value in values.items():
        record.setdefault(key, value)


def trace_file() -> IO[str] | None:
    """The file RADIXMESH_REQUEST_TRACE names (appended to, line-buffered), else None."""
    path = os.environ.get(ENV, "")
    if not path:
        return None
    return open(path.replace("{pid}", str(os.getpid())), "a", buffering=1)


class RequestTraceMiddleware:
    """Starts each HTTP request's record, notes when its first body bytes go out, writes it when it ends."""

    def __init__(self, app: ASGIApp, out: IO[str]) -> None:
        self.app = app
        self.out = out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record: dict[str, Any] = {"path": scope["path"], "t_http": time.perf_counter()}
        token = _record.set(record)

        async def send_and_note(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and message.get("body") and "t_first_body" not in record:
                record["t_first_body"] = time.perf_counter()

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            record["t_end"] = time.perf_counter()
            _record.reset(token)
            self.out.write(json.dumps(record, separators=(",", ":")) + "\n")
