"""The front end's client of the scheduler process (engine/client.py) over its real ZMQ sockets, with a stand-in
scheduler on the other end: queries and their answers, token streams, an abort when a stream is left early,
errors, block events, and a scheduler that dies."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import zmq
import zmq.asyncio

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.client import EngineClient
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.loader import PreparedModel
from radixmesh.wire.kv_events import BlocksStored, KVEventsMsg
from radixmesh.wire.messages import (
    AbortReqMsg,
    BatchOutMsg,
    FatalMsg,
    GenerateReqMsg,
    QueryOutMsg,
    ServerInfoReqMsg,
    TokenOut,
    encoder,
    to_scheduler_decoder,
)
from radixmesh.wire.sampling import SamplingParams

from .scheduler_factory import tiny_model_config


class Alive:
    """Stands in for the scheduler's process handle."""

    def __init__(self) -> None:
        self.alive, self.exitcode = True, None

    def is_alive(self) -> bool:
        return self.alive


Scheduler = Callable[[Any, Callable[[Any], Awaitable[None]]], Awaitable[None]]


async def with_client(scheduler: Scheduler, body: Callable[[EngineClient], Awaitable[Any]]) -> Any:
    """A client wired to `scheduler(msg, reply)` (called for every message it sends), running `body(client)`."""
    prepared = PreparedModel(model_path=None, config=tiny_model_config(), load_format="dummy", name="tiny",
                             tokenizer_path=None)
    client = EngineClient(EngineConfig(device="cpu"), prepared, None)
    to_sched, from_sched = f"ipc://{client._ipc_dir}/to", f"ipc://{client._ipc_dir}/from"
    client._send.bind(to_sched)
    client._recv.bind(from_sched)
    inbox, outbox = client._ctx.socket(zmq.PULL), client._ctx.socket(zmq.PUSH)
    inbox.connect(to_sched)
    outbox.connect(from_sched)
    proc = Alive()
    client._proc = proc

    async def reply(msg: Any) -> None:
        await outbox.send(encoder.encode(msg))

    async def serve() -> None:
        while True:
            await scheduler(to_scheduler_decoder.decode(await inbox.recv()), reply)

    tasks = [asyncio.create_task(serve()), asyncio.create_task(client._recv_loop())]
    client._tasks = tasks[1:]
    try:
        return await body(client)
    finally:
        tasks[0].cancel()
        await asyncio.gather(tasks[0], return_exceptions=True)
        proc.alive = False
        inbox.close(0)
        outbox.close(0)
        await client.shutdown()


def answering(outputs: dict[str, list[TokenOut]], seen: list[Any]) -> Scheduler:
    async def scheduler(msg: Any, reply: Callable[[Any], Awaitable[None]]) -> None:
        seen.append(msg)
        if isinstance(msg, ServerInfoReqMsg):
            await reply(QueryOutMsg(msg.query_id, {"num_running_reqs": 1}))
        elif isinstance(msg, GenerateReqMsg):
            for out in outputs.get(msg.rid, []):
                await reply(BatchOutMsg([out]))

    return scheduler


def test_a_query_gets_its_answer() -> None:
    seen: list[Any] = []

    async def body(client: EngineClient) -> dict[str, Any]:
        return await client.get_server_info()

    assert asyncio.run(with_client(answering({}, seen), body)) == {"num_running_reqs": 1}
    assert isinstance(seen[0], ServerInfoReqMsg)


def test_a_stream_ends_at_its_last_output_without_an_abort() -> None:
    seen: list[Any] = []
    outs = {"r": [TokenOut("r", [5], 3, 0, 1), TokenOut("r", [6], 3, 0, 2, finish_reason="length")]}

    async def body(client: EngineClient) -> list[list[int]]:
        return [out.token_ids async for out in client.generate_tokens([1, 2, 3], SamplingParams(max_new_tokens=2),
                                                                      "r")]

    assert asyncio.run(with_client(answering(outs, seen), body)) == [[5], [6]]
    assert [type(m).__name__ for m in seen] == ["GenerateReqMsg"]


def test_leaving_a_stream_early_aborts_the_request() -> None:
    seen: list[Any] = []
    outs = {"r": [TokenOut("r", [5], 3, 0, 1), TokenOut("r", [6], 3, 0, 2)]}

    async def body(client: EngineClient) -> None:
        async for _ in client.generate_tokens([1, 2, 3], SamplingParams(max_new_tokens=8), "r"):
            break
        for _ in range(100):
            if any(isinstance(m, AbortReqMsg) for m in seen):
                return
            await asyncio.sleep(0.01)

    asyncio.run(with_client(answering(outs, seen), body))
    assert AbortReqMsg("r") in seen


def test_an_error_output_is_the_requests_error() -> None:
    outs = {"r": [TokenOut("r", [], 3, 0, 0, finish_reason="error", error="the KV cache holds 4")]}

    async def body(client: EngineClient) -> None:
        async for _ in client.generate_tokens([1, 2, 3], SamplingParams(max_new_tokens=2), "r"):
            pass

    with pytest.raises(RadixMeshError) as info:
        asyncio.run(with_client(answering(outs, []), body))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and info.value.message == "the KV cache holds 4"


def test_bad_requests_are_refused_before_anything_is_sent() -> None:
    seen: list[Any] = []

    async def body(client: EngineClient) -> None:
        async for _ in client.generate_tokens([1] * 300, SamplingParams(max_new_tokens=2), "r"):
            pass

    with pytest.raises(RadixMeshError) as info:
        asyncio.run(with_client(answering({}, seen), body))
    assert info.value.param == "prompt" and seen == []


def test_block_events_reach_their_listener() -> None:
    got: list[KVEventsMsg] = []
    event = KVEventsMsg([BlocksStored([1, 2])], 16)

    async def scheduler(msg: Any, reply: Callable[[Any], Awaitable[None]]) -> None:
        await reply(event)
        await reply(QueryOutMsg(msg.query_id, {}))

    async def body(client: EngineClient) -> None:
        client.on_kv_events = got.append
        await client.get_server_info()

    asyncio.run(with_client(scheduler, body))
    assert got == [event]


def test_a_scheduler_that_dies_fails_what_waits_and_everything_after() -> None:
    async def scheduler(msg: Any, reply: Callable[[Any], Awaitable[None]]) -> None:
        await reply(FatalMsg("CUDA error: out of memory"))

    async def body(client: EngineClient) -> list[str]:
        errors = []
        for call in (client.get_server_info, client.get_server_info):
            try:
                await call()
            except RadixMeshError as exc:
                assert exc.code is ErrorCode.UNAVAILABLE
                errors.append(exc.message)
        assert not client.is_alive
        return errors

    first, second = asyncio.run(with_client(scheduler, body))
    assert first == "CUDA error: out of memory" and second.startswith("the engine is not running")


def test_branches_get_their_own_seeds() -> None:
    prepared = PreparedModel(model_path=None, config=tiny_model_config(), load_format="dummy", name="tiny",
                             tokenizer_path=None)

    async def make() -> EngineClient:
        return EngineClient(EngineConfig(device="cpu"), prepared, None)

    client = asyncio.run(make())
    try:
        assert client.branch_params(SamplingParams()) == [SamplingParams()]
        assert [p.seed for p in client.branch_params(SamplingParams(n=3, seed=7))] == [7, 8, 9]
        assert [p.seed for p in client.branch_params(SamplingParams(n=2))] == [None, None]
        assert client.describe()["model_name"] == "tiny" and client.context_len == 256
    finally:
        asyncio.run(client.shutdown())
