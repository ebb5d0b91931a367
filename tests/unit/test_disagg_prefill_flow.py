"""A prefill worker's side of a Prefill call (worker/disagg_prefill.py) over a stand-in scheduler: the start
checked, KV chunks streamed before the first token, the load tracked, and the exported KV released when the decode
worker says so, ends the call, or its lease runs out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.protocol import common_pb2, worker_pb2
from radixmesh.wire.convert import sampling_to_proto
from radixmesh.wire.disagg import KVChunk, KVExportMsg, PrefillReqMsg
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.sampling import SamplingParams
from radixmesh.worker.config import WorkerConfig
from radixmesh.worker.disagg_prefill import PrefillFlow, wait_release
from radixmesh.worker.load import LoadTracker


class FakeEngine:
    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        if not input_ids:
            raise RadixMeshError(ErrorCode.INVALID_ARGUMENT, "the prompt is empty", "prompt")


class FakeDisagg:
    """The scheduler's prefill side: `outputs` answer a prefill; releases are recorded."""

    def __init__(self, outputs: list[Any]) -> None:
        self.outputs = outputs
        self.prefills: list[PrefillReqMsg] = []
        self.released: list[str] = []
        self.load_seen: list[int] = []
        self.tracker: LoadTracker | None = None

    def prefill(self, msg: PrefillReqMsg) -> AsyncGenerator[Any, None]:
        self.prefills.append(msg)

        async def stream() -> AsyncGenerator[Any, None]:
            for out in self.outputs:
                if self.tracker is not None:
                    self.load_seen.append(self.tracker.num_queued_prefill_tokens)
                yield out

        return stream()

    async def release(self, transfer_id: str) -> None:
        self.released.append(transfer_id)


def start(ids: list[int] | None = None, start_pos: int = 2, transport: str = "grpc", lease_ms: int = 0,
          params: SamplingParams | None = None, rid: str = "r") -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(start=worker_pb2.PrefillStart(
        request_id=rid, token_ids=ids if ids is not None else [1, 2, 3, 4, 5], start_pos=start_pos,
        sampling_params=sampling_to_proto(params or SamplingParams(max_new_tokens=8)), kv_transport=transport,
        lease_ms=lease_ms, decode_worker_id="d0"))


def release(committed: bool = True) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(release=worker_pb2.PrefillRelease(committed=committed))


async def requests_of(*msgs: worker_pb2.PrefillRequest, hang: bool = False) -> AsyncIterator[Any]:
    for msg in msgs:
        yield msg
    if hang:
        await asyncio.sleep(3600)


CHUNK = KVExportMsg("r", "tx", 0, 1, KVChunk("grpc", 0, 2, 3, "float32", b"\x00" * 24, 24))
FIRST = TokenOut("r", [42], 5, 2, 1, logprobs=[-0.5], finish_reason="length")


def flow_of(outputs: list[Any], **config: Any) -> tuple[PrefillFlow, FakeDisagg, LoadTracker]:
    load = LoadTracker()
    flow = PrefillFlow(FakeEngine(), WorkerConfig(role="prefill", worker_id="p0", **config), load)  # type: ignore[arg-type]
    disagg = FakeDisagg(outputs)
    disagg.tracker = load
    flow.disagg = disagg  # type: ignore[assignment]
    return flow, disagg, load


def serve(flow: PrefillFlow, requests: AsyncIterator[Any]) -> list[worker_pb2.PrefillResponse]:
    async def run() -> list[worker_pb2.PrefillResponse]:
        return [msg async for msg in flow.serve(requests)]

    return asyncio.run(run())


def test_chunks_go_before_the_first_token_and_the_release_unlocks_the_kv() -> None:
    flow, disagg, load = flow_of([CHUNK, FIRST])
    out = serve(flow, requests_of(start(), release()))
    assert [m.WhichOneof("kind") for m in out] == ["kv_chunk", "result"]
    result = out[1].result
    assert (result.token_id, result.kv_bytes, result.worker_id, result.cached_tokens) == (42, 24, "p0", 2)
    (msg,) = disagg.prefills
    assert (msg.rid, msg.start_pos, msg.transport, msg.input_ids) == ("r", 2, "grpc", [1, 2, 3, 4, 5])
    assert disagg.released == [msg.transfer_id] and not load.active
    assert disagg.load_seen == [5, 5]  # the prompt counted as queued prefill work while it ran


def test_the_lease_is_the_shorter_of_the_decode_workers_and_this_ones() -> None:
    flow, disagg, _ = flow_of([FIRST], kv_lease_s=30.0)
    serve(flow, requests_of(start(lease_ms=2000), release()))
    serve(flow, requests_of(start(lease_ms=0), release()))
    serve(flow, requests_of(start(lease_ms=90_000), release()))
    assert [m.lease_s for m in disagg.prefills] == [2.0, 30.0, 30.0]


def test_without_a_release_the_lease_ends_the_wait() -> None:
    flow, disagg, _ = flow_of([FIRST])
    out = serve(flow, requests_of(start(lease_ms=50), hang=True))
    assert out[-1].HasField("result") and disagg.released == [disagg.prefills[0].transfer_id]


def closed_at_the_result(flow: Any) -> list[Any]:
    """Serve a call that the peer drops while the result is on its way (the transport's write of it is cancelled):
    the generator is closed at the result's yield. Returns the messages it gave."""
    async def run() -> list[Any]:
        out: list[Any] = []
        gen = flow.serve(requests_of(start(), hang=True))
        async for msg in gen:
            out.append(msg)
            if msg.HasField("result"):
                await gen.aclose()
                break
        return out

    return asyncio.run(run())


def test_a_call_closed_at_the_result_releases_the_kv() -> None:
    flow, disagg, _ = flow_of([CHUNK, FIRST])
    out = closed_at_the_result(flow)
    assert out[-1].HasField("result") and disagg.released == [disagg.prefills[0].transfer_id]


def test_an_aborted_prefill_releases_nothing_and_says_abort() -> None:
    flow, disagg, _ = flow_of([TokenOut("r", [], 5, 0, 0, finish_reason="abort")])
    out = serve(flow, requests_of(start(), hang=True))
    assert out[-1].result.finish_reason == common_pb2.FINISH_REASON_ABORT and disagg.released == []


@pytest.mark.parametrize(("first", "param"), [
    (worker_pb2.PrefillRequest(release=worker_pb2.PrefillRelease()), "start"),
    (start(transport="cuda-ipc"), "kv_transport"),
    (start(params=SamplingParams(n=2)), "n"),
    (start(start_pos=5), "start_pos"),
    (start(ids=[]), "prompt"),
])
def test_a_bad_start_is_refused_naming_the_field(first: worker_pb2.PrefillRequest, param: str) -> None:
    flow, disagg, _ = flow_of([FIRST], kv_transport="grpc")  # a fixed transport: another one asked is refused
    with pytest.raises(RadixMeshError) as info:
        serve(flow, requests_of(first))
    assert info.value.param == param and disagg.prefills == []


def test_a_request_id_already_running_here_is_refused() -> None:
    flow, _, load = flow_of([FIRST])
    with load.track("r", 3), pytest.raises(RadixMeshError) as info:
        serve(flow, requests_of(start(rid="r")))
    assert info.value.param == "request_id"


def test_an_empty_call_is_refused() -> None:
    flow, _, _ = flow_of([FIRST])
    with pytest.raises(RadixMeshError, match=r"starts with PrefillRequest\.start"):
        serve(flow, requests_of())


def test_wait_release_returns_on_a_release_the_end_or_the_lease() -> None:
    async def run() -> list[float]:
        loop = asyncio.get_running_loop()
        spent = []
        for requests, lease in ((requests_of(release(False)), 5.0), (requests_of(), 5.0),
                                (requests_of(hang=True), 0.05)):
            begin = loop.time()
            await wait_release(requests, lease)
            spent.append(loop.time() - begin)
        return spent

    given_up, ended, lapsed = asyncio.run(run())
    assert given_up < 1.0 and ended < 1.0 and 0.04 <= lapsed < 2.0
