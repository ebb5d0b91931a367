"""The exporting side of prefix sharing in a worker (worker/peer_export.py) over a stand-in scheduler: the start
checked (positions, vocabulary, the index epoch, the transport), the cached KV streamed with where it ends, and
the export released when the peer says so."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.protocol import worker_pb2
from radixmesh.wire.disagg import ExportCachedReqMsg, KVChunk, KVExportMsg
from radixmesh.wire.messages import TokenOut
from radixmesh.worker.config import WorkerConfig
from radixmesh.worker.peer_export import PeerExportFlow


class FakeEngine:
    """Answers an export of cached KV with `chunks`, then a TokenOut whose cached_tokens is where the KV ends."""

    def __init__(self, end: int, num_chunks: int = 1) -> None:
        self.end, self.num_chunks = end, num_chunks
        self.model_config = SimpleNamespace(vocab_size=100)
        self.config = SimpleNamespace(device="cpu")
        self.is_alive = True
        self.asked: list[ExportCachedReqMsg] = []
        self.sent: list[Any] = []

    async def stream(self, msg: ExportCachedReqMsg) -> AsyncGenerator[Any, None]:
        self.asked.append(msg)
        for i in range(self.num_chunks if self.end > msg.start_pos else 0):
            yield KVExportMsg(msg.rid, msg.transfer_id, i, self.num_chunks,
                              KVChunk("grpc", i, i + 1, self.end - msg.start_pos, "float32", b"\x00" * 32, 32))
        yield TokenOut(msg.rid, [], len(msg.input_ids), self.end, 0, finish_reason="length")

    async def send(self, msg: Any) -> None:
        self.sent.append(msg)


def start(ids: list[int] | None = None, start_pos: int = 2, epoch: int = 0, transport: str = "grpc",
          lease_ms: int = 0) -> worker_pb2.FetchKVRequest:
    return worker_pb2.FetchKVRequest(start=worker_pb2.FetchKVStart(
        request_id="r", token_ids=ids if ids is not None else list(range(1, 11)), start_pos=start_pos,
        kv_transport=transport, epoch=epoch, lease_ms=lease_ms, requester_worker_id="w2"))


def release() -> worker_pb2.FetchKVRequest:
    return worker_pb2.FetchKVRequest(release=worker_pb2.PrefillRelease(committed=True))


async def calls(*msgs: worker_pb2.FetchKVRequest, hang: bool = False) -> AsyncIterator[worker_pb2.FetchKVRequest]:
    for msg in msgs:
        yield msg
    if hang:
        await asyncio.sleep(3600)


def flow_of(engine: FakeEngine, epoch: int = 0, lease_s: float = 30.0) -> PeerExportFlow:
    return PeerExportFlow(engine, WorkerConfig(worker_id="w1", kv_lease_s=lease_s), lambda: epoch)  # type: ignore[arg-type]


def serve(flow: PeerExportFlow, requests: AsyncIterator[Any]) -> list[worker_pb2.FetchKVResponse]:
    async def run() -> list[worker_pb2.FetchKVResponse]:
        return [msg async for msg in flow.serve(requests)]

    return asyncio.run(run())


def test_cached_kv_streams_then_says_where_it_ends_and_is_released() -> None:
    engine = FakeEngine(end=8, num_chunks=2)
    out = serve(flow_of(engine), calls(start(), release()))
    assert [m.WhichOneof("kind") for m in out] == ["kv_chunk", "kv_chunk", "result"]
    result = out[-1].result
    assert (result.end_pos, result.kv_bytes, result.worker_id) == (8, 64, "w1")
    (asked,) = engine.asked
    assert asked.rid.startswith("r/export-") and asked.start_pos == 2 and asked.input_ids == list(range(1, 11))
    assert [type(m).__name__ for m in engine.sent] == ["ReleaseTransferMsg"]
    assert engine.sent[0].transfer_id == asked.transfer_id


def test_a_call_closed_at_the_result_releases_the_export() -> None:
    engine = FakeEngine(end=8)

    async def run() -> None:  # the peer drops the call while the result is on its way
        gen = flow_of(engine).serve(calls(start(), hang=True))
        async for msg in gen:
            if msg.HasField("result"):
                await gen.aclose()
                break

    asyncio.run(run())
    assert [type(m).__name__ for m in engine.sent] == ["ReleaseTransferMsg"]
    assert engine.sent[0].transfer_id == engine.asked[0].transfer_id


def test_nothing_cached_past_the_start_sends_no_kv_and_holds_nothing() -> None:
    engine = FakeEngine(end=2)
    out = serve(flow_of(engine), calls(start(start_pos=2), hang=True))
    assert [m.WhichOneof("kind") for m in out] == ["result"] and out[0].result.end_pos == 2
    assert engine.sent == []  # no release to wait for


def test_the_lease_bounds_the_wait_for_a_release() -> None:
    engine = FakeEngine(end=6)
    serve(flow_of(engine, lease_s=30.0), calls(start(lease_ms=50), hang=True))
    assert engine.asked[0].lease_s == 0.05 and len(engine.sent) == 1


@pytest.mark.parametrize(("first", "code", "param"), [
    (worker_pb2.FetchKVRequest(release=worker_pb2.PrefillRelease()), ErrorCode.INVALID_ARGUMENT, "start"),
    (start(start_pos=10), ErrorCode.INVALID_ARGUMENT, "start_pos"),
    (start(ids=[]), ErrorCode.INVALID_ARGUMENT, "start_pos"),
    (start(ids=[1, 2, 300]), ErrorCode.INVALID_ARGUMENT, "token_ids"),
    (start(transport="pigeon"), ErrorCode.INVALID_ARGUMENT, "kv_transport"),
    (start(transport="cuda-ipc"), ErrorCode.UNSUPPORTED, "kv_transport"),  # a CPU pool
])
def test_a_bad_start_is_refused_before_anything_is_exported(first: worker_pb2.FetchKVRequest, code: ErrorCode,
                                                            param: str) -> None:
    engine = FakeEngine(end=6)
    with pytest.raises(RadixMeshError) as info:
        serve(flow_of(engine), calls(first))
    assert info.value.code is code and info.value.param == param and engine.asked == []


def test_an_index_entry_of_another_life_of_this_worker_is_refused() -> None:
    engine = FakeEngine(end=6)
    with pytest.raises(RadixMeshError) as info:
        serve(flow_of(engine, epoch=3), calls(start(epoch=2)))
    assert info.value.code is ErrorCode.ABORTED and "epoch 3, not 2" in info.value.message
    serve(flow_of(engine, epoch=3), calls(start(epoch=3), release()))  # the current epoch: served
    serve(flow_of(engine, epoch=0), calls(start(epoch=2), release()))  # no index here: no epoch to check
    assert len(engine.asked) == 2
