"""A TCP proxy on 127.0.0.1 that can add delay to every chunk or cut every connection.

It runs its own event loop in a daemon thread, so a synchronous harness can switch its mode
while a router streams gRPC through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Literal

from radixmesh.index.redis_server import free_port

Mode = Literal["pass", "delay", "cut"]


class FaultProxy:
    """Forwards 127.0.0.1:<port> to `target` (host:port). Modes: pass; delay (each chunk, either way,
    waits `delay_s` before it is forwarded); cut (open connections are closed, new ones refused)."""

    def __init__(self, target: str, delay_s: float = 0.2) -> None:
        self.target_host, target_port = target.rsplit(":", 1)
        self.target_port = int(target_port)
        self.delay_s = delay_s
        self.port = free_port("127.0.0.1")
        self.mode: Mode = "pass"
        self.num_connections = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    def set_mode(self, mode: Mode) -> None:
        """Switch mode; `cut` also closes every open connection now."""
        asyncio.run_coroutine_threadsafe(self._set_mode(mode), self._loop).result(10)

    def stop(self) -> None:
        self.set_mode("cut")
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _set_mode(self, mode: Mode) -> None:
        self.mode = mode
        if mode == "cut":
            for writer in list(self._writers):
                writer.transport.abort()  # RST, as a dropped link or a dead host would show

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "cut":
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.num_connections += 1
        self._writers.update((writer, up_writer))
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward chunks in order; in delay mode each leaves `delay_s` after it arrived (added latency,
        not a throughput cap: later chunks wait in the queue meanwhile)."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.create_task(self._send(queue, writer))
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while chunk := await reader.read(65536):
                due = loop.time() + (self.delay_s if self.mode == "delay" else 0.0)
                queue.put_nowait((due, chunk))
        queue.put_nowait((0.0, b""))
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await sender
        writer.transport.abort()

    async def _send(self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, chunk = await queue.get()
            if not chunk or self.mode == "cut" or writer.is_closing():
                return
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            writer.write(chunk)
            await writer.drain()
