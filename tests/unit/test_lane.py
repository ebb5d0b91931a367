"""The Generate lane on its own: a real LaneServer and LaneClient on 127.0.0.1 in one event loop. Streams,
several at once on one connection, the peer's errors as it sent them, frames, large messages, headers
(cancel, disconnects and drain: test_lane_lifecycle.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from radixmesh.common import tracing
from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.common.grpc_errors import (
    ERROR_METADATA_KEY,
    abort_with,
    error_detail_bytes,
    error_from_detail,
    map_errors,
)
from radixmesh.common.lane import (
    END,
    HEADER,
    MAX_FRAME_BYTES,
    MESSAGE,
    OPEN,
    LaneBroken,
    LaneContext,
    _Aborted,
    _frame,
    _open_body,
    _parse_open,
    _read_frame,
)
from tests.lane_helpers import HOST, Handler, Request, Response, generate, lane, read_all, three, within


class Failing:
    """A servicer whose Generate goes through map_errors, as the worker's and router's do."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    @map_errors("worker")
    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        yield Response(request_id=request.request_id, token_ids=[1])
        raise self.error


# ---- streams ------------------------------------------------------------------------------------------------
def test_a_stream_delivers_its_messages_in_order_then_ends() -> None:
    seen: list[Any] = []

    async def handler(request: Any, context: LaneContext) -> AsyncIterator[Any]:
        seen.append(request)
        async for msg in three(request, context):
            yield msg

    async def run() -> None:
        async with lane(handler) as (_, client):
            stream = await generate(client, "r1", list(range(4096)))
            messages = await read_all(stream)
            assert [(m.request_id, list(m.token_ids), m.prompt_tokens) for m in messages] == \
                [("r1", [0], 4096), ("r1", [1], 4096), ("r1", [2], 4096)]
            assert await stream.read() is None  # stays ended
            assert list(seen[0].token_ids) == list(range(4096)) and seen[0].request_id == "r1"
            assert stream.stream_id not in stream.conn.queues  # forgotten once ended

    asyncio.run(run())


def test_concurrent_streams_share_one_connection_and_get_only_their_own_messages() -> None:
    n = 8
    started: list[str] = []
    all_started = asyncio.Event()

    async def handler(request: Any, context: LaneContext) -> AsyncIterator[Any]:
        started.append(request.request_id)
        if len(started) == n:
            all_started.set()
        await all_started.wait()  # every handler is running at once before any sends
        for i in range(4):
            yield Response(request_id=request.request_id, token_ids=[i])
            await asyncio.sleep(0)  # let the other streams' messages interleave on the socket

    async def run() -> None:
        async with lane(handler) as (server, client):
            streams = [await generate(client, f"r{k}") for k in range(n)]
            results = await within(asyncio.gather(*(read_all(s) for s in streams)))
            for k, messages in enumerate(results):
                assert [(m.request_id, list(m.token_ids)) for m in messages] == [(f"r{k}", [i]) for i in range(4)]
            assert len({s.stream_id for s in streams}) == n
            assert all(s.conn is client._conn for s in streams)
            assert len(server._connections) == 1

    asyncio.run(run())


# ---- errors ------------------------------------------------------------------------------------------------
def test_map_errors_carries_the_handlers_error_exactly() -> None:
    servicer = Failing(RadixMeshError(ErrorCode.INVALID_ARGUMENT, "bad n", "n"))

    async def run() -> None:
        async with lane(servicer.Generate) as (_, client):
            stream = await generate(client)
            first = await within(stream.read())
            assert first is not None and list(first.token_ids) == [1]
            with pytest.raises(RadixMeshError) as info:
                await within(stream.read())
            assert not isinstance(info.value, LaneBroken)
            assert (info.value.code, info.value.message, info.value.param) == (ErrorCode.INVALID_ARGUMENT, "bad n", "n")
            assert await stream.read() is None
            again = await generate(client, "next")  # the connection goes on
            assert (await within(again.read())).request_id == "next"
            with pytest.raises(RadixMeshError, match="bad n"):
                await within(again.read())

    asyncio.run(run())


async def plain_failure(request: Any, context: LaneContext) -> AsyncIterator[Any]:
    yield Response(token_ids=[1])
    raise ValueError("boom")


@pytest.mark.parametrize("handler", [Failing(ValueError("boom")).Generate, plain_failure],
                         ids=["map_errors", "undecorated"])
def test_an_unexpected_exception_ends_the_stream_with_internal(handler: Handler) -> None:
    async def run() -> None:
        async with lane(handler) as (_, client):
            stream = await generate(client)
            assert await within(stream.read()) is not None
            with pytest.raises(RadixMeshError) as info:
                await within(stream.read())
            assert info.value.code is ErrorCode.INTERNAL and not isinstance(info.value, LaneBroken)
            assert "boom" in info.value.message

    asyncio.run(run())


async def plain_domain_error(request: Any, context: LaneContext) -> AsyncIterator[Any]:
    yield Response(token_ids=[1])
    raise RadixMeshError(ErrorCode.RESOURCE_EXHAUSTED, "queue full", "max_queued")


def test_an_undecorated_handlers_own_error_crosses_as_it_was_raised() -> None:
    async def run() -> None:
        async with lane(plain_domain_error) as (_, client):
            stream = await generate(client)
            assert await within(stream.read()) is not None
            with pytest.raises(RadixMeshError) as info:
                await within(stream.read())
            got = (info.value.code, info.value.message, info.value.param)
            assert got == (ErrorCode.RESOURCE_EXHAUSTED, "queue full", "max_queued")

    asyncio.run(run())


def test_an_unknown_method_is_unsupported() -> None:
    async def run() -> None:
        async with lane(three) as (_, client):
            stream = await client.open("Nope", Request(), Response)
            with pytest.raises(RadixMeshError) as info:
                await within(stream.read())
            assert info.value.code is ErrorCode.UNSUPPORTED and "Nope" in info.value.message
            assert len(await read_all(await generate(client))) == 3

    asyncio.run(run())


async def raw_frames(reader: asyncio.StreamReader, stream_id: int) -> list[tuple[int, bytes]]:
    """The frames of one stream read off a raw connection, up to its END."""
    frames = []
    while True:
        kind, sid, body = await within(_read_frame(reader))
        assert sid == stream_id
        frames.append((kind, body))
        if kind == END:
            return frames


def test_a_malformed_open_is_invalid_argument_and_the_connection_goes_on() -> None:
    async def run() -> None:
        async with lane(three) as (server, _):
            reader, writer = await asyncio.open_connection(HOST, server.port)
            try:
                for stream_id, body in ((1, _open_body("Generate", {}, b"\xff\xff\xff")),  # not a GenerateRequest
                                        (2, b"\x01")):  # not even an OPEN body
                    writer.write(_frame(OPEN, stream_id, body))
                    ((kind, detail),) = await raw_frames(reader, stream_id)
                    error = error_from_detail(detail)
                    assert kind == END and error.code is ErrorCode.INVALID_ARGUMENT
                    assert "malformed lane request" in error.message
                writer.write(_frame(OPEN, 3, _open_body("Generate", {}, Request(request_id="ok").SerializeToString())))
                frames = await raw_frames(reader, 3)
                assert [k for k, _ in frames] == [MESSAGE, MESSAGE, MESSAGE, END] and frames[-1][1] == b""
                assert Response.FromString(frames[0][1]).request_id == "ok"
            finally:
                writer.close()

    asyncio.run(run())


@pytest.mark.parametrize("length", [4, MAX_FRAME_BYTES + 1])
def test_a_frame_length_out_of_bounds_drops_the_connection(length: int) -> None:
    async def run() -> None:
        async with lane(three) as (server, _):
            reader, writer = await asyncio.open_connection(HOST, server.port)
            writer.write(HEADER.pack(length, OPEN, 1))
            assert await within(reader.read()) == b""  # the server closed it, sending nothing
            writer.close()

    asyncio.run(run())


def test_lane_context_abort_without_an_error_trailer_is_internal() -> None:
    async def run() -> None:
        context = LaneContext({})
        with pytest.raises(_Aborted) as info:
            await context.abort(grpc.StatusCode.NOT_FOUND, "gone")
        error = error_from_detail(info.value.detail)
        assert (error.code, error.message) == (ErrorCode.INTERNAL, "gone")
        with pytest.raises(_Aborted) as info:
            await context.abort(grpc.StatusCode.NOT_FOUND)
        assert error_from_detail(info.value.detail).message == str(grpc.StatusCode.NOT_FOUND)
        exact = error_detail_bytes(RadixMeshError(ErrorCode.NOT_FOUND, "no such request", "rid"), "worker")
        context.set_trailing_metadata((("other", b"x"), (ERROR_METADATA_KEY, exact)))
        with pytest.raises(_Aborted) as info:
            await context.abort(grpc.StatusCode.NOT_FOUND, "ignored")
        assert info.value.detail == exact

    asyncio.run(run())


def test_a_handler_aborting_its_context_ends_the_stream_with_that_error() -> None:
    async def aborts(request: Any, context: LaneContext) -> AsyncIterator[Any]:
        yield Response()
        if request.request_id == "plain":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "nope")
        await abort_with(context, RadixMeshError(ErrorCode.NOT_FOUND, "no such request", "rid"), "worker")

    async def run() -> None:
        async with lane(aborts) as (_, client):
            for rid, expected in (("plain", (ErrorCode.INTERNAL, "nope", None)),
                                  ("exact", (ErrorCode.NOT_FOUND, "no such request", "rid"))):
                stream = await generate(client, rid)
                assert await within(stream.read()) is not None
                with pytest.raises(RadixMeshError) as info:
                    await within(stream.read())
                assert (info.value.code, info.value.message, info.value.param) == expected

    asyncio.run(run())


def test_abort_with_inside_map_errors_keeps_its_error() -> None:
    class Aborting:
        @map_errors("worker")
        async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
            yield Response()
            await abort_with(context, RadixMeshError(ErrorCode.NOT_FOUND, "no such request", "rid"), "worker")

    async def run() -> None:
        async with lane(Aborting().Generate) as (_, client):
            stream = await generate(client)
            assert await within(stream.read()) is not None
            with pytest.raises(RadixMeshError) as info:
                await within(stream.read())
            assert (info.value.code, info.value.message) == (ErrorCode.NOT_FOUND, "no such request")

    asyncio.run(run())


# ---- large messages, headers -------------------------------------------------------------------------------
def test_large_messages_pass_intact() -> None:
    ids = list(range(2_000_000))

    async def echo(request: Any, context: LaneContext) -> AsyncIterator[Any]:
        yield Response(request_id=request.request_id, token_ids=request.token_ids)
        yield Response(token_ids=[7])

    async def run() -> None:
        async with lane(echo) as (_, client):
            assert Response(token_ids=ids).ByteSize() > 4 * 1024 * 1024
            messages = await read_all(await generate(client, "big", ids))
            assert len(messages) == 2 and messages[0].request_id == "big"
            assert list(messages[0].token_ids) == ids and list(messages[1].token_ids) == [7]

    asyncio.run(run())


def test_with_tracing_off_a_stream_carries_no_headers_and_no_span() -> None:
    seen: list[dict[str, str]] = []

    async def handler(request: Any, context: LaneContext) -> AsyncIterator[Any]:
        seen.append(context.headers)
        yield Response()

    async def run() -> None:
        async with lane(handler) as (_, client):
            stream = await generate(client)
            assert len(await read_all(stream)) == 1
            assert stream.span is None and seen == [{}]

    assert not tracing.enabled()
    assert tracing.start_client_span("Generate") == (None, {})
    asyncio.run(run())


def test_the_open_body_round_trips_method_headers_and_request() -> None:
    request = Request(request_id="r", token_ids=[1, 2, 3]).SerializeToString()
    headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "a=1,b=2"}
    assert _parse_open(_open_body("Generate", headers, request)) == ("Generate", headers, request)
    assert _parse_open(_open_body("Generate", {}, b"")) == ("Generate", {}, b"")
    assert _parse_open(_open_body("Gen", {"k": "x=y"}, b"\n=\n"))[1:] == ({"k": "x=y"}, b"\n=\n")
    assert _parse_open(_open_body("Gen", {"k": "é"}, b""))[1] == {"k": "?"}  # headers are ascii


def test_headers_of_an_open_reach_the_handlers_context() -> None:
    seen: list[dict[str, str]] = []

    async def handler(request: Any, context: LaneContext) -> AsyncIterator[Any]:
        seen.append(context.headers)
        yield Response()

    async def run() -> None:
        async with lane(handler) as (server, _):
            reader, writer = await asyncio.open_connection(HOST, server.port)
            headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
            writer.write(_frame(OPEN, 1, _open_body("Generate", headers, Request().SerializeToString())))
            assert [k for k, _ in await raw_frames(reader, 1)] == [MESSAGE, END]
            assert seen == [headers]
            writer.close()

    asyncio.run(run())
