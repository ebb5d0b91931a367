"""The worker's side of disaggregation messages (engine/disagg/client.py) over a stand-in engine client: what each
call sends, how replies become grants or errors, and what is cleaned up when a call fails or stops early."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.disagg.client import REPLY_MARGIN_S, DisaggClient, Grant
from radixmesh.wire.disagg import (
    CancelReservationMsg,
    KVChunk,
    KVChunkInMsg,
    KVExportMsg,
    PrefillReqMsg,
    ReleaseTransferMsg,
    ReserveReqMsg,
    ResolveReservationMsg,
    TransferDoneReqMsg,
)
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.sampling import SamplingParams

PARAMS = SamplingParams(max_new_tokens=2)


class FakeEngine:
    """Records what is sent; answers queries from `replies`; streams `outputs`."""

    def __init__(self, replies: list[Any] | None = None, outputs: list[Any] | None = None,
                 alive: bool = True) -> None:
        self.replies = replies or []
        self.outputs = outputs or []
        self.is_alive = alive
        self.sent: list[Any] = []
        self.queries: list[tuple[Any, float | None]] = []
        self.stream_closed = False

    async def query(self, msg: Any, timeout_s: float | None = None) -> dict[str, Any]:
        self.queries.append((msg, timeout_s))
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return dict(reply)

    async def send(self, msg: Any) -> None:
        self.sent.append(msg)

    async def stream(self, msg: Any) -> AsyncGenerator[Any, None]:
        self.sent.append(msg)
        try:
            for out in self.outputs:
                yield out
        finally:
            self.stream_closed = True


def client(engine: FakeEngine) -> DisaggClient:
    return DisaggClient(engine)  # type: ignore[arg-type]


def test_a_granted_reservation_is_a_grant_and_waits_up_to_its_lease() -> None:
    engine = FakeEngine([{"ok": True, "prefix_len": 4, "num_reserved_tokens": 12, "lease_s": 9.5}])
    grant = asyncio.run(client(engine).reserve("r", [1, 2, 3], PARAMS, 10.0))
    (msg, timeout), = engine.queries
    assert isinstance(msg, ReserveReqMsg) and msg.rid == "r" and msg.lease_s == 10.0 and msg.input_ids == [1, 2, 3]
    assert timeout == 10.0 + REPLY_MARGIN_S
    assert grant == Grant(msg.reservation_id, 4, 12, 9.5)


def test_a_refusal_is_resource_exhausted_naming_why() -> None:
    engine = FakeEngine([{"ok": False, "error": "no KV slots became free within the lease"}])
    with pytest.raises(RadixMeshError) as info:
        asyncio.run(client(engine).reserve("r", [1], PARAMS, 1.0))
    assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED
    assert info.value.message == "KV reservation refused: no KV slots became free within the lease"
    assert engine.sent == []  # a refused reservation holds nothing


def test_a_reservation_cut_short_is_cancelled() -> None:
    engine = FakeEngine([asyncio.CancelledError()])
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(client(engine).reserve("r", [1], PARAMS, 1.0))
    (cancel,) = engine.sent
    (reserve, _), = engine.queries
    assert cancel == CancelReservationMsg(reserve.reservation_id)


def test_chunks_land_and_a_finished_transfer_counts_its_bytes() -> None:
    chunk = KVChunk("grpc", 0, 1, 2, "float32", b"\x00" * 16, 16)
    engine = FakeEngine([{"ok": True, "num_bytes": 4096}, {"ok": False, "error": "KV of 2 layers did not arrive"}])
    c = client(engine)
    asyncio.run(c.land("res", chunk))
    assert engine.sent == [KVChunkInMsg("res", chunk)]
    assert asyncio.run(c.transfer_done("res")) == 4096
    assert isinstance(engine.queries[0][0], TransferDoneReqMsg) and engine.queries[0][0].reservation_id == "res"
    with pytest.raises(RadixMeshError) as info:
        asyncio.run(c.transfer_done("res"))
    assert info.value.code is ErrorCode.UNAVAILABLE and "2 layers did not arrive" in info.value.message


def test_a_resolved_reservation_streams_its_tokens() -> None:
    outs = [TokenOut("r", [5], 3, 0, 1), TokenOut("r", [6], 3, 0, 2, finish_reason="length")]
    engine = FakeEngine(outputs=outs)
    msg = ResolveReservationMsg("r", "res", [1, 2, 3], PARAMS, first_token=5)

    async def run() -> list[TokenOut]:
        return [out async for out in client(engine).resolve(msg)]

    assert asyncio.run(run()) == outs and engine.sent == [msg] and engine.stream_closed


def test_leaving_a_resolved_stream_early_closes_it() -> None:
    engine = FakeEngine(outputs=[TokenOut("r", [5], 3, 0, 1), TokenOut("r", [6], 3, 0, 2)])

    async def run() -> None:
        stream = client(engine).resolve(ResolveReservationMsg("r", "res", [1], PARAMS, first_token=5))
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(run())
    assert engine.stream_closed


def test_a_resolved_stream_carries_tokens_only() -> None:
    engine = FakeEngine(outputs=[KVExportMsg("r", "tx", 0, 1, KVChunk("grpc", 0, 1, 1, "float32", b"", 0))])

    async def run() -> None:
        async for _ in client(engine).resolve(ResolveReservationMsg("r", "res", [1], PARAMS, first_token=5)):
            pass

    with pytest.raises(AssertionError, match="streams tokens only"):
        asyncio.run(run())


def test_the_prefill_side_streams_chunks_then_the_first_token_and_releases() -> None:
    chunk = KVExportMsg("p", "tx", 0, 1, KVChunk("grpc", 0, 2, 4, "float32", b"\x01" * 8, 8))
    first = TokenOut("p", [9], 4, 0, 1, finish_reason="length")
    engine = FakeEngine(outputs=[chunk, first])
    msg = PrefillReqMsg("p", "tx", [1, 2, 3, 4], PARAMS, 0, "grpc", 5.0)

    async def run() -> list[Any]:
        c = client(engine)
        got = [out async for out in c.prefill(msg)]
        await c.release("tx")
        return got

    assert asyncio.run(run()) == [chunk, first]
    assert engine.sent == [msg, ReleaseTransferMsg("tx")]


def test_nothing_is_sent_to_a_scheduler_that_is_gone() -> None:
    engine = FakeEngine(alive=False)
    c = client(engine)
    asyncio.run(c.cancel("res"))
    asyncio.run(c.release("tx"))
    assert engine.sent == []
