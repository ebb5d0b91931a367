"""The Generate lane: a service's streamed Generate over one plain TCP connection per peer, next to its gRPC port.

Why: a Python gRPC call costs about 1 ms per hop before the server's handler runs (thread hand-offs inside
grpcio that grow when the process was idle), against ~0.1 ms for a message on an open socket; the gateway ->
router -> worker path pays it twice before a prompt reaches the engine. The lane carries the same protobuf
messages, with the same error details, so a service's Generate handler serves both transports unchanged.

Frames, both directions: `<u32 body length><u8 kind><u32 stream id>` then the body (length counts kind and id).
- OPEN (client): `<u16 len>method <u16 len>headers` (ascii `key=value` lines: the trace context) + request bytes
- MESSAGE (server): one response message
- END (server): empty when the stream ended well, else a serialized `ErrorDetail` (as gRPC's error trailer)
- CANCEL (client): the caller left; the server cancels the handler (a worker aborts the request)

Plaintext only: with TLS the services keep Generate on gRPC (a server does not open a lane, a client does
not use one). Health, control RPCs and everything else stay on gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import struct
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc.aio
from google.protobuf.message import Message

from radixmesh.common import tracing
from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.common.grpc_errors import ERROR_METADATA_KEY, error_detail_bytes, error_from_detail

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<IBI")
OPEN, MESSAGE, END, CANCEL = 1, 2, 3, 4
_BROKEN = 0  # client side only: the connection went away
MAX_FRAME_BYTES = 64 * 1024 * 1024 + 65536
KEEPALIVE = ((socket.TCP_KEEPIDLE, 10), (socket.TCP_KEEPINTVL, 5), (socket.TCP_KEEPCNT, 2)) \
    if hasattr(socket, "TCP_KEEPIDLE") else ()

GENERATE_TRANSPORTS = ("lane", "grpc")
"""How a service sends Generate to its targets: lane (when the target advertises one) | grpc (always)."""
TRANSPORT_HELP = ("how Generate reaches the next service: lane (its plain-TCP Generate lane when it advertises one, "
                  "~1 ms less per hop; gRPC otherwise and with TLS) or grpc")

M = TypeVar("M", bound=Message)
Handler = Callable[[Any, Any], AsyncIterator[Any]]
"""A servicer's streaming method, called as `handler(request, context)`."""


class LaneBroken(RadixMeshError):
    """The lane itself failed (refused, reset, closed mid-stream): the peer's transport, not its answer."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.UNAVAILABLE, message)


def _frame(kind: int, stream_id: int, body: bytes = b"") -> bytes:
    return HEADER.pack(len(body) + 5, kind, stream_id) + body


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    length, kind, stream_id = HEADER.unpack(await reader.readexactly(HEADER.size))
    if not 5 <= length <= MAX_FRAME_BYTES:
        raise ConnectionError(f"lane frame of {length} bytes (at most {MAX_FRAME_BYTES})")
    return kind, stream_id, await reader.readexactly(length - 5) if length > 5 else b""


def _keepalive(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in KEEPALIVE:
        sock.setsockopt(socket.IPPROTO_TCP, option, value)


def _open_body(method: str, headers: Mapping[str, str], request: bytes) -> bytes:
    name = method.encode()
    meta = "".join(f"{k}={v}\n" for k, v in headers.items()).encode("ascii", "replace")
    return struct.pack("<H", len(name)) + name + struct.pack("<H", len(meta)) + meta + request


def _parse_open(body: bytes) -> tuple[str, dict[str, str], bytes]:
    (n,) = struct.unpack_from("<H", body, 0)
    method = body[2:2 + n].decode()
    (m,) = struct.unpack_from("<H", body, 2 + n)
    meta = body[4 + n:4 + n + m].decode("ascii", "replace")
    headers = dict(line.split("=", 1) for line in meta.splitlines() if "=" in line)
    return method, headers, body[4 + n + m:]


# ---- server ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaneMethod:
    """One streaming method a lane serves: how to parse its request and the servicer method to call."""

    request_type: type[Message]
    handler: Handler
    span_name: str
    """The server span's name (the gRPC method's full name, as the gRPC interceptor names it)."""


class _Aborted(grpc.aio.AbortError):
    """What `LaneContext.abort` raises (an AbortError, as gRPC's: `map_errors` lets it through unchanged)."""

    def __init__(self, detail: bytes) -> None:
        super().__init__("aborted")
        self.detail = detail


class LaneContext:
    """What a lane gives a servicer method as its context: enough for `map_errors` to end the call with an
    error. Handlers served on a lane must not need more (the router's and worker's Generate do not)."""

    def __init__(self, headers: Mapping[str, str]) -> None:
        self.headers = dict(headers)
        self._trailing: tuple[tuple[str, Any], ...] = ()

    def set_trailing_metadata(self, trailing: tuple[tuple[str, Any], ...]) -> None:
        self._trailing = tuple(trailing)

    async def abort(self, code: Any, details: str = "") -> None:
        detail = next((v for k, v in self._trailing if k == ERROR_METADATA_KEY), None)
        if not isinstance(detail, bytes):
            detail = error_detail_bytes(RadixMeshError(ErrorCode.INTERNAL, details or str(code)))
        raise _Aborted(detail)


class LaneServer:
    """Serves `methods` on host:port (0: a free port) until closed."""

    def __init__(self, methods: Mapping[str, LaneMethod], name: str) -> None:
        self.methods = dict(methods)
        self.name = name
        self.port = 0
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._streams: set[asyncio.Task[None]] = set()
        self._draining = False

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._accept, host, port, limit=1 << 20)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.get_running_loop().create_task(self._serve(reader, writer), name=f"lane-{self.name}")
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _keepalive(writer)
        streams: dict[int, asyncio.Task[None]] = {}
        try:
            while True:
                kind, stream_id, body = await _read_frame(reader)
                if kind == OPEN:
                    task = asyncio.get_running_loop().create_task(self._run(stream_id, body, writer))
                    streams[stream_id] = task
                    self._streams.add(task)
                    task.add_done_callback(functools.partial(self._forget, streams, stream_id))
                elif kind == CANCEL and stream_id in streams:
                    streams[stream_id].cancel()
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            if not isinstance(exc, asyncio.IncompleteReadError):
                logger.info("%s lane: connection closed: %s", self.name, exc)
        finally:
            for task in list(streams.values()):  # the caller is gone: its streams end (workers abort them)
                task.cancel()
            writer.close()

    def _forget(self, streams: dict[int, asyncio.Task[None]], stream_id: int, task: asyncio.Task[None]) -> None:
        streams.pop(stream_id, None)
        self._streams.discard(task)

    async def _run(self, stream_id: int, body: bytes, writer: asyncio.StreamWriter) -> None:
        try:
            method_name, headers, payload = _parse_open(body)
            method = self.methods.get(method_name)
            if method is None:
                raise RadixMeshError(ErrorCode.UNSUPPORTED, f"{self.name} lane has no method {method_name!r}")
            if self._draining:
                raise RadixMeshError(ErrorCode.UNAVAILABLE, f"{self.name} is shutting down")
            request = method.request_type.FromString(payload)
        except RadixMeshError as exc:
            writer.write(_frame(END, stream_id, error_detail_bytes(exc, self.name)))
            return
        except Exception as exc:  # a malformed frame: this stream's error, the connection goes on
            writer.write(_frame(END, stream_id, error_detail_bytes(
                RadixMeshError(ErrorCode.INVALID_ARGUMENT, f"malformed lane request: {exc}"), self.name)))
            return
        with tracing.server_span_from(method.span_name, headers):
            try:
                async for msg in method.handler(request, LaneContext(headers)):
                    writer.write(_frame(MESSAGE, stream_id, msg.SerializeToString()))
                    await writer.drain()
                writer.write(_frame(END, stream_id))
            except _Aborted as exc:
                writer.write(_frame(END, stream_id, exc.detail))
            except RadixMeshError as exc:  # a handler without map_errors: its error as it is
                writer.write(_frame(END, stream_id, error_detail_bytes(exc, self.name)))
            except ConnectionError:
                return  # the caller is gone
            except Exception as exc:  # a handler without map_errors: still one clear error, never a hung stream
                logger.exception("%s lane: %s failed", self.name, method_name)
                writer.write(_frame(END, stream_id, error_detail_bytes(
                    RadixMeshError(ErrorCode.INTERNAL, f"{self.name} {method_name} failed: {exc}"), self.name)))

    async def close(self, grace_s: float = 0.0) -> None:
        """Stop accepting; streams already open get `grace_s` to finish, then are cancelled."""
        self._draining = True
        if self._server is not None:
            self._server.close()
        if self._streams and grace_s > 0:
            await asyncio.wait(list(self._streams), timeout=grace_s)
        for task in [*self._streams, *self._connections]:
            task.cancel()
        await asyncio.gather(*self._streams, *self._connections, return_exceptions=True)


# ---- client ------------------------------------------------------------------------------------------------
class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        self.writer = writer
        self.peer = peer
        self.queues: dict[int, asyncio.Queue[tuple[int, bytes]]] = {}
        self.alive = True
        self.task = asyncio.get_running_loop().create_task(self._read(reader), name=f"lane-to-{peer}")

    async def _read(self, reader: asyncio.StreamReader) -> None:
        why = "closed by the peer"
        try:
            while True:
                kind, stream_id, body = await _read_frame(reader)
                queue = self.queues.get(stream_id)
                if queue is not None:
                    queue.put_nowait((kind, body))
        except asyncio.IncompleteReadError:
            pass
        except (ConnectionError, OSError) as exc:
            why = str(exc) or type(exc).__name__
        finally:
            self.alive = False
            self.writer.close()
            for queue in self.queues.values():
                queue.put_nowait((_BROKEN, why.encode()))


class LaneStream(Generic[M]):
    """One open stream: `read` its messages until None; `cancel` when leaving before that (idempotent)."""

    def __init__(self, conn: _Connection, stream_id: int, response_type: type[M], where: str,
                 span: Any = None) -> None:
        self.conn, self.stream_id, self.response_type, self.where = conn, stream_id, response_type, where
        self.span = span
        """The stream's CLIENT span (tracing on), ended with the stream."""
        self.queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
        self.finished = False
        conn.queues[stream_id] = self.queue

    async def read(self) -> M | None:
        """The next message; None once the peer ended the stream well; raises the peer's error as it sent it,
        or `LaneBroken` when the connection went away."""
        if self.finished:
            return None
        kind, body = await self.queue.get()
        if kind == MESSAGE:
            return self.response_type.FromString(body)
        self._finish()
        if kind == END:
            if body:
                raise error_from_detail(body)
            return None
        raise LaneBroken(f"service unavailable ({self.where}): {body.decode()}")

    def _finish(self) -> None:
        self.finished = True
        self.conn.queues.pop(self.stream_id, None)
        if self.span is not None:
            self.span.end()

    def cancel(self) -> None:
        """Leave the stream: the peer cancels its handler (a no-op once the stream ended)."""
        if self.finished:
            return
        self._finish()
        if self.conn.alive:
            self.conn.writer.write(_frame(CANCEL, self.stream_id))


class LaneClient:
    """Streams to one peer's lane over one connection, opened on first use and again after it breaks."""

    def __init__(self, host: str, port: int, peer: str, connect_timeout_s: float = 1.0) -> None:
        self.host, self.port, self.peer = host, port, peer
        self.connect_timeout_s = connect_timeout_s
        self._conn: _Connection | None = None
        self._connecting: asyncio.Lock | None = None
        self._next_id = 0

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    async def _connection(self) -> _Connection:
        if self._conn is not None and self._conn.alive:
            return self._conn
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._conn is None or not self._conn.alive:
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(self.host, self.port, limit=1 << 20), self.connect_timeout_s)
                except (OSError, asyncio.TimeoutError) as exc:
                    raise LaneBroken(f"service unavailable ({self.peer}): lane {self.address}: "
                                     f"{str(exc) or type(exc).__name__}") from None
                _keepalive(writer)
                self._conn = _Connection(reader, writer, self.peer)
            return self._conn

    async def open(self, method: str, request: Message, response_type: type[M], span_name: str = "") -> LaneStream[M]:
        """Start `method` on the peer (connecting first if needed; `LaneBroken` when it cannot). `span_name`:
        the CLIENT span's name when tracing is on (the gRPC method's full name, as its interceptor names it)."""
        conn = await self._connection()
        self._next_id += 1
        span, headers = tracing.start_client_span(span_name or method)
        stream = LaneStream(conn, self._next_id, response_type, f"{self.peer}, lane {self.address}", span)
        conn.writer.write(_frame(OPEN, stream.stream_id, _open_body(method, headers, request.SerializeToString())))
        return stream

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await conn.task


class PeerLane:
    """One peer's Generate lane as the peer last reported it (GetLoad's `lane_port`), for the services that call
    it (a router's worker clients, a gateway's targets). `open` answers None when there is no lane or it cannot be
    reached: the caller uses gRPC. A port that refused is not used again until the peer reports another one or
    was seen down (`forget_refusal`)."""

    def __init__(self, address: str, peer: str) -> None:
        """`address`: the peer's gRPC host:port (the lane is on the same host)."""
        self.host = address.rsplit(":", 1)[0].strip("[]")
        self.peer = peer
        self.client: LaneClient | None = None
        self._refused_port = 0

    def learn(self, port: int) -> None:
        """The peer reports its lane on `port` (0: none)."""
        if (port and port == self._refused_port) or port == (self.client.port if self.client is not None else 0):
            return
        old, self._refused_port = self.client, 0
        self.client = LaneClient(self.host, port, self.peer) if port else None
        if old is not None:
            asyncio.get_running_loop().create_task(old.close())

    def forget_refusal(self) -> None:
        """The peer was seen down: the port it reports when back is tried again, even the one that refused."""
        self._refused_port = 0

    async def open(self, method: str, request: Message, response_type: type[M],
                   span_name: str = "") -> LaneStream[M] | None:
        """`LaneClient.open` on the lane; None without one, or when it cannot be reached (then dropped)."""
        client = self.client
        if client is None:
            return None
        try:
            return await client.open(method, request, response_type, span_name)
        except LaneBroken as exc:
            logger.info("%s: %s; Generate over gRPC", self.peer, exc.message)
            if self.client is client:
                self.client, self._refused_port = None, client.port
            await client.close()
            return None

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await client.close()
