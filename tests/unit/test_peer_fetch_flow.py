"""The fetching side of prefix sharing in a worker (worker/peer_fetch.py) over stand-ins for its scheduler and the
peer: when it fetches at all, the commit of a fetched prefix, and the fallback (computing here) for every way a
fetch can fail."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

import grpc.aio
import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.disagg.client import Grant
from radixmesh.protocol import worker_pb2
from radixmesh.wire.disagg import CommitFetchMsg, PrefixLenReqMsg, TrimReservationMsg
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.sampling import SamplingParams
from radixmesh.worker.config import WorkerConfig
from radixmesh.worker.fetch_cost import FetchDecision
from radixmesh.worker.peer_fetch import PeerFetchFlow, kv_bytes_per_token

PARAMS = SamplingParams(max_new_tokens=2)
IDS = list(range(1, 101))


class FakeEngine:
    """The scheduler's side: what this worker holds of a prefix, and the requests it was given."""

    def __init__(self, held: int = 0) -> None:
        self.held = held
        self.model_config = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8)
        self.config = SimpleNamespace(device="cpu", dtype="float32", kv_cache_dtype="auto")
        self.sent: list[Any] = []
        self.streams: list[Any] = []

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        pass

    async def query(self, msg: Any, timeout_s: float | None = None) -> dict[str, int]:
        assert isinstance(msg, PrefixLenReqMsg)
        return {"device_len": self.held, "host_len": 0}

    async def send(self, msg: Any) -> None:
        self.sent.append(msg)

    async def stream(self, msg: Any) -> AsyncGenerator[TokenOut, None]:
        self.streams.append(msg)
        yield TokenOut(msg.rid, [7], len(msg.input_ids), 0, 1, finish_reason="length")

    async def generate_tokens(self, ids: list[int], params: SamplingParams, rid: str) -> AsyncGenerator[TokenOut, None]:
        self.streams.append(("local", rid))
        yield TokenOut(rid, [8], len(ids), 0, 1, finish_reason="length")


class FakeDisagg:
    def __init__(self, refuse: bool = False, prefix_len: int = 0) -> None:
        self.refuse, self.prefix_len = refuse, prefix_len
        self.log: list[str] = []

    async def reserve(self, rid: str, ids: list[int], params: SamplingParams, lease_s: float) -> Grant:
        if self.refuse:
            raise RadixMeshError(ErrorCode.RESOURCE_EXHAUSTED, "KV reservation refused")
        self.log.append(f"reserve {len(ids)}")
        return Grant("res", self.prefix_len, len(ids) - self.prefix_len, lease_s)

    async def land(self, reservation_id: str, chunk: Any) -> None:
        self.log.append(f"land {chunk.num_tokens}")

    async def transfer_done(self, reservation_id: str) -> int:
        self.log.append("done")
        return 1024

    async def cancel(self, reservation_id: str) -> None:
        self.log.append("cancel")


class FakeCall:
    def __init__(self, answers: list[Any], hang: bool = False) -> None:
        self.answers, self.hang = list(answers), hang
        self.written: list[str] = []
        self.cancelled = False

    async def write(self, msg: worker_pb2.FetchKVRequest) -> None:
        self.written.append(msg.WhichOneof("kind") or "")

    async def read(self) -> Any:
        if self.hang:
            await asyncio.sleep(3600)
        if not self.answers:
            return grpc.aio.EOF
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> None:
        self.cancelled = True


class Peers:
    def __init__(self, call: FakeCall) -> None:
        self.call = call

    def stub(self, address: str) -> Any:
        return SimpleNamespace(FetchKV=lambda: self.call)

    async def close(self) -> None:
        pass


def chunk(num_tokens: int) -> worker_pb2.FetchKVResponse:
    return worker_pb2.FetchKVResponse(kv_chunk=worker_pb2.KVChunk(transport="grpc", layer_begin=0, layer_end=2,
                                                                  num_tokens=num_tokens, dtype="float32"))


def result(end: int) -> worker_pb2.FetchKVResponse:
    return worker_pb2.FetchKVResponse(result=worker_pb2.FetchKVResult(end_pos=end, kv_bytes=1024, worker_id="p"))


PEER = worker_pb2.PeerPrefix(worker_id="p", address="127.0.0.1:9", num_tokens=64, epoch=3)


def flow_of(call: FakeCall, engine: FakeEngine | None = None, disagg: FakeDisagg | None = None,
            **config: Any) -> tuple[PeerFetchFlow, FakeEngine, FakeDisagg]:
    engine, disagg = engine or FakeEngine(), disagg or FakeDisagg()
    settings: dict[str, Any] = dict(worker_id="me", peer_fetch="always", peer_fetch_min_tokens=8,
                                    peer_fetch_timeout_s=5.0)
    settings.update(config)
    flow = PeerFetchFlow(engine, WorkerConfig(**settings), Peers(call))  # type: ignore[arg-type]
    flow.disagg = disagg  # type: ignore[assignment]
    return flow, engine, disagg


def generate(flow: PeerFetchFlow, peer: worker_pb2.PeerPrefix = PEER, params: SamplingParams = PARAMS,
             ) -> list[TokenOut]:
    async def run() -> list[TokenOut]:
        outs = [out async for out in flow.generate("r", IDS, params, peer)]
        await asyncio.sleep(0)  # the release runs off the request's path
        return outs

    return asyncio.run(run())


def test_the_kv_size_of_a_token_follows_the_pool_dtype() -> None:
    engine = FakeEngine()
    assert kv_bytes_per_token(engine) == 2 * 2 * 2 * 8 * 4  # type: ignore[arg-type]
    engine.config.kv_cache_dtype = "fp8_e4m3"
    assert kv_bytes_per_token(engine) == 2 * 2 * 2 * 8  # type: ignore[arg-type]


def test_a_fetched_prefix_is_committed_and_the_request_runs_on_it() -> None:
    call = FakeCall([chunk(64), result(64)])
    flow, engine, disagg = flow_of(call)
    outs = generate(flow)
    assert disagg.log == ["reserve 64", "land 64", "done"] and call.written == ["start", "release"]
    (commit,) = engine.streams
    assert isinstance(commit, CommitFetchMsg) and commit.fallback_reason == "" and commit.reservation_id == "res"
    assert outs[0].token_ids == [7]


def test_a_peer_holding_less_than_asked_trims_the_reservation() -> None:
    flow, engine, _ = flow_of(FakeCall([chunk(40), result(40)]))
    generate(flow)
    assert engine.sent == [TrimReservationMsg("res", 40)]


@pytest.mark.parametrize(("config", "engine", "peer", "params"), [
    ({"worker_id": "p"}, FakeEngine(), PEER, PARAMS),  # the peer is this worker
    ({}, FakeEngine(), PEER, SamplingParams(logprob_start_len=0)),  # prompt log-probs are computed here
    ({}, FakeEngine(held=60), PEER, PARAMS),  # holds all but 4 of the 64 itself
])
def test_when_not_to_fetch_the_request_is_an_ordinary_one(config: dict[str, Any], engine: FakeEngine,
                                                          peer: worker_pb2.PeerPrefix, params: SamplingParams) -> None:
    flow, engine, disagg = flow_of(FakeCall([]), engine, **config)
    outs = generate(flow, peer, params)
    assert engine.streams == [("local", "r")] and disagg.log == [] and outs[0].token_ids == [8]


@pytest.mark.parametrize(("mode", "fetches"), [("auto", False), ("always", True)])
def test_auto_fetches_only_when_the_cost_model_says_fetching_is_cheaper(mode: str, fetches: bool) -> None:
    flow, engine, disagg = flow_of(FakeCall([chunk(64), result(64)]), peer_fetch=mode)
    asked: list[int] = []

    def decide(num_tokens: int) -> FetchDecision:
        asked.append(num_tokens)
        return FetchDecision(False, 0.2, 0.1)  # computing (0.1 s) beats fetching (0.2 s)

    flow.costs.decide = decide  # type: ignore[method-assign]
    generate(flow)
    assert asked == [64] and (disagg.log != []) is fetches
    assert isinstance(engine.streams[0], CommitFetchMsg) is fetches


@pytest.mark.parametrize(("answers", "disagg", "reason"), [
    ([RadixMeshError(ErrorCode.UNAVAILABLE, "connection refused")], FakeDisagg(), "peer_unavailable"),
    ([], FakeDisagg(), "peer_unavailable"),  # the call ended without a result
    ([RadixMeshError(ErrorCode.ABORTED, "epoch 4, not 3")], FakeDisagg(), "peer_stale"),
    ([RadixMeshError(ErrorCode.INTERNAL, "boom")], FakeDisagg(), "peer_error"),
    ([result(0)], FakeDisagg(), "peer_holds_nothing"),
])
def test_a_failed_fetch_frees_the_reservation_and_computes_here(answers: list[Any], disagg: FakeDisagg,
                                                                reason: str) -> None:
    flow, engine, _ = flow_of(FakeCall(answers), disagg=disagg)
    generate(flow)
    (commit,) = engine.streams
    assert isinstance(commit, CommitFetchMsg) and commit.fallback_reason == reason


def test_a_refused_reservation_is_an_ordinary_request() -> None:
    flow, engine, _ = flow_of(FakeCall([]), disagg=FakeDisagg(refuse=True))
    generate(flow)
    assert engine.streams == [("local", "r")]


def test_a_slow_peer_is_given_up() -> None:
    call = FakeCall([], hang=True)
    flow, engine, _ = flow_of(call, peer_fetch_timeout_s=0.05)
    generate(flow)
    assert engine.streams[0].fallback_reason == "peer_timeout" and call.cancelled


def test_the_fetched_token_count_is_read_once() -> None:
    flow, _, _ = flow_of(FakeCall([chunk(64), result(64)]))

    async def run() -> list[int]:
        counts = []
        async for _ in flow.generate("r", IDS, PARAMS, PEER):
            counts.append(flow.take_fetched("r"))
            counts.append(flow.take_fetched("r"))
        return counts

    assert asyncio.run(run()) == [64, 0]
