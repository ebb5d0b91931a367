"""The Generate lane's life cycle: cancel, disconnects, restarts, drain, and a peer's lane as its callers keep it
(what port it reports, one that refused)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.common.lane import LaneBroken, LaneClient, LaneContext, LaneMethod, PeerLane
from radixmesh.gateway.upstreams import Upstream
from radixmesh.protocol import worker_pb2
from tests.lane_helpers import (
    HOST,
    Request,
    Response,
    blocking,
    generate,
    lane,
    open_blocked,
    read_all,
    three,
    within,
)
from tests.ports import free_port


# ---- cancel and disconnects --------------------------------------------------------------------------------
def test_cancel_ends_the_handler_and_the_connection_goes_on() -> None:
    async def run() -> None:
        started, ended = asyncio.Event(), asyncio.Event()
        async with lane(blocking(started, ended)) as (server, client):
            stream = await open_blocked(client, started)
            conn = client._conn
            stream.cancel()
            await within(ended.wait())  # the server cancelled the handler: its finally ran
            stream.cancel()  # again: nothing happens
            assert await stream.read() is None
            server.methods["Generate"] = LaneMethod(Request, three, "Generate")
            assert len(await read_all(await generate(client))) == 3
            assert client._conn is conn and conn is not None and conn.alive

    asyncio.run(run())


def test_closing_the_client_cancels_its_handlers_on_the_server() -> None:
    async def run() -> None:
        started, ended = asyncio.Event(), asyncio.Event()
        async with lane(blocking(started, ended)) as (server, client):
            stream = await open_blocked(client, started)
            await client.close()
            await within(ended.wait())
            with pytest.raises(LaneBroken):
                await within(stream.read())
            server.methods["Generate"] = LaneMethod(Request, three, "Generate")
            assert len(await read_all(await generate(client))) == 3  # opened again on next use

    asyncio.run(run())


def test_a_server_that_closes_breaks_the_pending_read() -> None:
    async def run() -> None:
        started, ended = asyncio.Event(), asyncio.Event()
        async with lane(blocking(started, ended)) as (server, client):
            stream = await open_blocked(client, started)
            pending = asyncio.ensure_future(stream.read())
            await asyncio.sleep(0)  # the read is waiting
            await within(server.close())
            assert ended.is_set()
            with pytest.raises(LaneBroken) as info:
                await within(pending)
            assert info.value.code is ErrorCode.UNAVAILABLE and "w0" in info.value.message
            assert client._conn is not None and not client._conn.alive

    asyncio.run(run())


def test_nothing_listening_is_lane_broken() -> None:
    async def run() -> None:
        port = free_port()
        client = LaneClient(HOST, port, "w0")
        with pytest.raises(LaneBroken) as info:
            await within(generate(client))
        assert info.value.code is ErrorCode.UNAVAILABLE and f"{HOST}:{port}" in info.value.message
        await client.close()

    asyncio.run(run())


def test_a_connect_timeout_is_lane_broken() -> None:
    async def run() -> None:
        async with lane(three) as (server, _):
            client = LaneClient(HOST, server.port, "w0", connect_timeout_s=0)  # gives up before connecting
            with pytest.raises(LaneBroken) as info:
                await within(generate(client))
            assert info.value.code is ErrorCode.UNAVAILABLE
            await client.close()

    asyncio.run(run())


def test_a_connect_timeout_names_the_timeout() -> None:
    async def run() -> None:
        client = LaneClient(HOST, free_port(), "w0", connect_timeout_s=0)
        with pytest.raises(LaneBroken, match="TimeoutError"):
            await within(generate(client))

    asyncio.run(run())


def test_the_client_reconnects_after_the_server_restarts() -> None:
    async def run() -> None:
        started, ended = asyncio.Event(), asyncio.Event()
        async with lane(blocking(started, ended)) as (server, client):
            stream = await generate(client)
            assert await within(stream.read()) is not None
            old = client._conn
            await within(server.close())
            with pytest.raises(LaneBroken):
                await within(stream.read())
            with pytest.raises(LaneBroken):  # nothing listening now
                await within(generate(client))
            async with lane(three, port=server.port) as (restarted, _):
                assert restarted.port == server.port
                assert len(await read_all(await generate(client))) == 3
                assert client._conn is not old and client._conn is not None and client._conn.alive

    asyncio.run(run())


# ---- drain -------------------------------------------------------------------------------------------------
def test_a_draining_server_finishes_open_streams_and_refuses_new_ones() -> None:
    release = asyncio.Event()

    async def handler(request: Any, context: LaneContext) -> AsyncIterator[Any]:
        yield Response(request_id=request.request_id, token_ids=[0])
        await release.wait()
        yield Response(request_id=request.request_id, token_ids=[1])

    async def run() -> None:
        async with lane(handler) as (server, client):
            stream = await generate(client, "open")
            assert await within(stream.read()) is not None
            closing = asyncio.ensure_future(server.close(grace_s=5))
            await asyncio.sleep(0)  # close has started: draining, the listening socket closed
            assert server._draining and not closing.done()
            late = await generate(client, "late")  # on the connection already open
            with pytest.raises(RadixMeshError) as info:
                await within(late.read())
            assert info.value.code is ErrorCode.UNAVAILABLE and not isinstance(info.value, LaneBroken)
            with pytest.raises(LaneBroken):  # no new connections
                await within(generate(LaneClient(HOST, server.port, "w0")))
            release.set()
            assert [list(m.token_ids) for m in await read_all(stream)] == [[1]]
            await within(closing)

    asyncio.run(run())


def test_a_drain_cancels_streams_still_running_after_the_grace() -> None:
    async def run() -> None:
        started, ended = asyncio.Event(), asyncio.Event()
        async with lane(blocking(started, ended)) as (server, client):
            stream = await open_blocked(client, started)
            await within(server.close(grace_s=0.01))  # the handler never ends by itself
            assert ended.is_set()
            with pytest.raises(LaneBroken):
                await within(stream.read())

    asyncio.run(run())


# ---- a peer's lane as callers keep it ------------------------------------------------------------------------
def test_a_peer_lane_opens_streams_on_the_port_the_peer_reports() -> None:
    async def run() -> None:
        async with lane(three) as (server, _):
            peer = PeerLane(f"{HOST}:50051", "w0")
            assert await peer.open("Generate", Request(), Response) is None  # nothing learnt: gRPC
            peer.learn(server.port)
            stream = await peer.open("Generate", Request(request_id="a"), Response)
            assert stream is not None and len(await read_all(stream)) == 3
            first = peer.client
            peer.learn(server.port)  # the same report again: the same connection
            assert peer.client is first
            peer.learn(0)  # the peer has no lane any more
            assert peer.client is None and await peer.open("Generate", Request(), Response) is None
            await peer.close()

    asyncio.run(run())


def test_a_refused_port_is_not_retried_until_the_peer_was_seen_down() -> None:
    async def run() -> None:
        port = free_port()
        peer = PeerLane("[::1]:50051", "w0")
        assert peer.host == "::1"
        peer = PeerLane(f"{HOST}:50051", "w0")
        peer.learn(port)  # nothing listens there
        assert await peer.open("Generate", Request(), Response) is None and peer.client is None
        peer.learn(port)  # reported again by the next probe: still refused, not tried
        assert peer.client is None
        async with lane(three, port=port):
            peer.learn(port)
            assert peer.client is None, "the same port is not tried again while the peer was not seen down"
            peer.forget_refusal()
            peer.learn(port)
            stream = await peer.open("Generate", Request(), Response)
            assert stream is not None and len(await read_all(stream)) == 3
        await peer.close()

    asyncio.run(run())


class _LoadStub:
    """GetLoad of a router that reports its lane on `port`; counts the questions."""

    def __init__(self, port: int) -> None:
        self.port, self.asked = port, 0

    async def GetLoad(self, request: Any, timeout: float) -> Any:
        self.asked += 1
        return worker_pb2.GetLoadResponse(lane_port=self.port)


def test_a_gateway_target_asks_for_the_lane_once_per_time_it_comes_up() -> None:
    async def run() -> None:
        port = free_port()
        stub = _LoadStub(port)
        target = Upstream("router", f"{HOST}:1", lambda channel: stub, use_lane=True)
        assert target.lane is not None
        await target.check_lane(True, 1.0)
        await target.check_lane(True, 1.0)
        assert stub.asked == 1, "asked once while it stays up"
        assert await target.lane.open("Generate", Request(), Response) is None  # refused: gRPC, lane dropped
        await target.check_lane(False, 1.0)  # seen down: it may come back on the same port
        async with lane(three, port=port):
            await target.check_lane(True, 1.0)
            assert stub.asked == 2
            stream = await target.lane.open("Generate", Request(), Response)
            assert stream is not None and len(await read_all(stream)) == 3
        await target.close()

    asyncio.run(run())
