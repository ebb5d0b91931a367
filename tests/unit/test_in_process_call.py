"""The embedded router's stream adapter behaves as the part of a grpc.aio call the gateway uses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import grpc.aio
import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.gateway.embedded_router import InProcessCall


def test_reads_messages_then_eof_and_keeps_answering_eof() -> None:
    async def run() -> None:
        async def stream() -> AsyncGenerator[int, None]:
            yield 1
            yield 2

        call = InProcessCall(stream())  # type: ignore[arg-type]
        assert [await call.read(), await call.read()] == [1, 2]
        assert await call.read() is grpc.aio.EOF and call.done()
        assert await call.read() is grpc.aio.EOF
        assert call.cancel() is False  # finished: nothing to cancel

    asyncio.run(run())


def test_the_routers_error_comes_out_as_it_is() -> None:
    async def run() -> None:
        async def stream() -> AsyncGenerator[int, None]:
            yield 1
            raise RadixMeshError(ErrorCode.UNAVAILABLE, "worker w0 failed mid-stream")

        call = InProcessCall(stream())  # type: ignore[arg-type]
        assert await call.read() == 1
        with pytest.raises(RadixMeshError, match="failed mid-stream") as err:
            await call.read()
        assert err.value.code is ErrorCode.UNAVAILABLE and call.done()

    asyncio.run(run())


def test_cancel_closes_the_stream_once() -> None:
    async def run() -> None:
        closed = asyncio.Event()

        async def stream() -> AsyncGenerator[int, None]:
            try:
                yield 1
                await asyncio.Event().wait()  # a worker that never answers again
                yield 2
            finally:
                closed.set()  # the router's cleanup: the worker's call is cancelled here

        call = InProcessCall(stream())  # type: ignore[arg-type]
        assert await call.read() == 1
        assert call.cancel() is True and call.done()
        assert call.cancel() is False
        await asyncio.wait_for(closed.wait(), 5)
        assert await call.read() is grpc.aio.EOF

    asyncio.run(run())
