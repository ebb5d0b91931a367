"""What the lane tests share: a real LaneServer and LaneClient on 127.0.0.1 in one event loop, and handlers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from radixmesh.common.lane import LaneClient, LaneContext, LaneMethod, LaneServer, LaneStream
from radixmesh.protocol import worker_pb2

Request, Response = worker_pb2.GenerateRequest, worker_pb2.GenerateResponse
Handler = Callable[[Any, LaneContext], AsyncIterator[Any]]
T = TypeVar("T")
HOST = "127.0.0.1"


def within(aw: Awaitable[T]) -> Awaitable[T]:
    """Every wait in these tests is bounded: a hang fails the test instead of stalling the run."""
    return asyncio.wait_for(aw, 5)


@contextlib.asynccontextmanager
async def lane(handler: Handler, port: int = 0) -> AsyncIterator[tuple[LaneServer, LaneClient]]:
    """A server with `handler` as its Generate, and a client to it (both closed on the way out)."""
    server = LaneServer({"Generate": LaneMethod(Request, handler, "/radixmesh.v1.WorkerService/Generate")}, "worker")
    await server.start(HOST, port)
    client = LaneClient(HOST, server.port, "w0")
    try:
        yield server, client
    finally:
        await client.close()
        await server.close()


async def read_all(stream: LaneStream[Any]) -> list[Any]:
    messages = []
    while (msg := await within(stream.read())) is not None:
        messages.append(msg)
    return messages


async def generate(client: LaneClient, rid: str = "r", token_ids: list[int] | None = None) -> LaneStream[Any]:
    return await client.open("Generate", Request(request_id=rid, token_ids=token_ids or []), Response)


async def three(request: Any, context: LaneContext) -> AsyncIterator[Any]:
    for i in range(3):
        yield Response(request_id=request.request_id, token_ids=[i], prompt_tokens=len(request.token_ids))


def blocking(started: asyncio.Event, ended: asyncio.Event) -> Handler:
    """A handler that sends one message, then waits for an event that never fires; `ended` when it stops."""
    never = asyncio.Event()

    async def handler(request: Any, context: LaneContext) -> AsyncIterator[Any]:
        try:
            yield Response(request_id=request.request_id, token_ids=[0])
            started.set()
            await never.wait()
        finally:
            ended.set()

    return handler


async def open_blocked(client: LaneClient, started: asyncio.Event) -> LaneStream[Response]:
    """A stream whose handler (`blocking`) sent its first message and now waits."""
    stream = await generate(client)
    assert await within(stream.read()) is not None
    await within(started.wait())
    return stream
