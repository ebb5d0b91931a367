"""`serve`'s listening socket: its connections send small writes at once (no Nagle delay)."""

from __future__ import annotations

import asyncio
import socket

from radixmesh.gateway.server import bind_socket


def test_accepted_connections_have_nagle_off() -> None:
    """asyncio sets TCP_NODELAY only on sockets whose protocol is TCP; a socket made with protocol 0 would keep
    Nagle's algorithm, and a response body written after its headers would wait ~40 ms for a delayed ACK."""

    async def run() -> int:
        sock = bind_socket("127.0.0.1", 0)
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                conn = transport.get_extra_info("socket")
                accepted.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            nodelay = await asyncio.wait_for(accepted, 10)
            writer.close()
            return nodelay
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(run()) != 0
