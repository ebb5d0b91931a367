"""A decode worker's side of a Prefill call (worker/disagg_decode.py) over stand-ins for its scheduler and the
prefill worker: the commit when the KV and first token come, and the fallback (the prompt computed here) for
every way the exchange can fail; aborts on either side."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import grpc.aio
import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.disagg.client import Grant
from radixmesh.protocol import common_pb2, worker_pb2
from radixmesh.wire.disagg import ResolveReservationMsg
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.sampling import SamplingParams
from radixmesh.worker.config import WorkerConfig
from radixmesh.worker.disagg_decode import DecodeFlow, local_only_reason

PARAMS = SamplingParams(max_new_tokens=3, temperature=0.0)
TARGET = worker_pb2.PrefillTarget(worker_id="p0", address="127.0.0.1:9")


class FakeEngine:
    def __init__(self) -> None:
        self.local: list[str] = []

    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        if not input_ids:
            raise RadixMeshError(ErrorCode.INVALID_ARGUMENT, "the prompt is empty", "prompt")

    async def generate_tokens(self, input_ids: list[int], params: SamplingParams,
                              rid: str) -> AsyncGenerator[TokenOut, None]:
        self.local.append(rid)
        yield TokenOut(rid, [1], len(input_ids), 0, 1, finish_reason="length")


class FakeDisagg:
    """The scheduler's disaggregation side: grants, lands, confirms, resolves."""

    def __init__(self, refuse: bool = False, done_error: str | None = None) -> None:
        self.refuse, self.done_error = refuse, done_error
        self.log: list[str] = []
        self.resolved: list[ResolveReservationMsg] = []

    async def reserve(self, rid: str, input_ids: list[int], params: SamplingParams, lease_s: float) -> Grant:
        if self.refuse:
            raise RadixMeshError(ErrorCode.RESOURCE_EXHAUSTED, "KV reservation refused: full")
        self.log.append(f"reserve {rid}")
        return Grant(f"res-{rid}", 2, len(input_ids) - 2, lease_s)

    async def land(self, reservation_id: str, chunk: Any) -> None:
        self.log.append(f"land {chunk.layer_begin}-{chunk.layer_end}")

    async def transfer_done(self, reservation_id: str) -> int:
        if self.done_error:
            raise RadixMeshError(ErrorCode.UNAVAILABLE, self.done_error)
        self.log.append("done")
        return 512

    async def cancel(self, reservation_id: str) -> None:
        self.log.append(f"cancel {reservation_id}")

    def resolve(self, msg: ResolveReservationMsg) -> AsyncGenerator[TokenOut, None]:
        self.resolved.append(msg)

        async def tokens() -> AsyncGenerator[TokenOut, None]:
            first = [msg.first_token] if msg.first_token >= 0 else []
            yield TokenOut(msg.rid, first, len(msg.input_ids), msg.cached_tokens, len(first), finish_reason="length")

        return tokens()


class FakeCall:
    """The Prefill bidi call: what the prefill worker answers, in order (or a hang, or an error)."""

    def __init__(self, answers: list[Any], hang: bool = False) -> None:
        self.answers, self.hang = list(answers), hang
        self.written: list[str] = []
        self.cancelled = False

    async def write(self, msg: worker_pb2.PrefillRequest) -> None:
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
        self.written.append("done_writing")

    def cancel(self) -> None:
        self.cancelled = True


class Peers:
    def __init__(self, call: FakeCall) -> None:
        self.call = call

    def stub(self, address: str) -> Any:
        return type("Stub", (), {"Prefill": lambda _self: self.call})()

    async def close(self) -> None:
        pass


def chunk_msg(begin: int, end: int) -> worker_pb2.PrefillResponse:
    return worker_pb2.PrefillResponse(kv_chunk=worker_pb2.KVChunk(transport="grpc", layer_begin=begin,
                                                                  layer_end=end, num_tokens=4, dtype="float32"))


def result_msg(token: int = 42, finish: int = common_pb2.FINISH_REASON_LENGTH) -> worker_pb2.PrefillResponse:
    result = worker_pb2.PrefillResult(prompt_tokens=6, cached_tokens=1, finish_reason=finish, token_id=token,
                                      logprob=-0.25)
    result.top_logprobs.entries.add(token_id=token, logprob=-0.25)
    return worker_pb2.PrefillResponse(result=result)


def flow_of(call: FakeCall, disagg: FakeDisagg | None = None,
            timeout_s: float = 5.0) -> tuple[DecodeFlow, FakeEngine, FakeDisagg]:
    engine, disagg = FakeEngine(), disagg or FakeDisagg()
    flow = DecodeFlow(engine, WorkerConfig(role="decode", prefill_timeout_s=timeout_s, kv_lease_s=10.0),  # type: ignore[arg-type]
                      Peers(call))  # type: ignore[arg-type]
    flow.disagg = disagg  # type: ignore[assignment]
    return flow, engine, disagg


async def collect(flow: DecodeFlow, rid: str = "r", params: SamplingParams = PARAMS) -> list[TokenOut]:
    outs = [out async for out in flow.generate(rid, [1, 2, 3, 4, 5, 6], params, TARGET)]
    await asyncio.sleep(0)  # the release runs off the request's path
    return outs


def test_prompt_logprobs_and_grammars_are_prefilled_here() -> None:
    assert local_only_reason(SamplingParams(logprob_start_len=0)) == "prompt log-probs"
    assert local_only_reason(SamplingParams(regex="a+")) == "a grammar"
    assert local_only_reason(PARAMS) is None
    flow, engine, disagg = flow_of(FakeCall([]))
    outs = asyncio.run(collect(flow, params=SamplingParams(regex="a+")))
    assert engine.local == ["r"] and disagg.log == [] and outs[0].token_ids == [1]


def test_the_kv_and_first_token_commit_and_decoding_goes_on_here() -> None:
    call = FakeCall([chunk_msg(0, 1), chunk_msg(1, 2), result_msg(42)])
    flow, _, disagg = flow_of(call)
    outs = asyncio.run(collect(flow))
    assert disagg.log == ["reserve r", "land 0-1", "land 1-2", "done"]
    (resolve,) = disagg.resolved
    assert (resolve.first_token, resolve.logprob, resolve.cached_tokens) == (42, -0.25, 1)
    assert resolve.top_logprobs == [(42, -0.25)] and not resolve.fallback_reason
    assert outs[0].token_ids == [42]
    assert call.written[0] == "start" and "release" in call.written  # the prefill worker may let go


@pytest.mark.parametrize(("answers", "disagg", "reason"), [
    ([RadixMeshError(ErrorCode.UNAVAILABLE, "connection refused")], FakeDisagg(), "prefill_unavailable"),
    ([], FakeDisagg(), "prefill_unavailable"),  # the call ended without a result
    ([RadixMeshError(ErrorCode.INVALID_ARGUMENT, "bad start_pos")], FakeDisagg(), "prefill_error"),
    ([chunk_msg(0, 2), result_msg()], FakeDisagg(done_error="KV of 1 layers did not arrive"), "transfer_failed"),
    ([], FakeDisagg(refuse=True), "reservation_refused"),
])
def test_every_failure_before_the_commit_computes_the_prompt_here(answers: list[Any], disagg: FakeDisagg,
                                                                    reason: str) -> None:
    flow, _, disagg = flow_of(FakeCall(answers), disagg)
    outs = asyncio.run(collect(flow))
    (resolve,) = disagg.resolved
    assert resolve.fallback_reason == reason and resolve.first_token == -1
    assert resolve.reservation_id == ("" if reason == "reservation_refused" else "res-r")
    assert outs[0].finish_reason == "length"


def test_a_prefill_worker_that_takes_too_long_is_given_up() -> None:
    call = FakeCall([], hang=True)
    flow, _, disagg = flow_of(call, timeout_s=0.05)
    asyncio.run(collect(flow))
    assert disagg.resolved[0].fallback_reason == "prefill_timeout" and call.cancelled


def test_an_abort_on_the_prefill_worker_ends_the_sequence_here() -> None:
    flow, _, disagg = flow_of(FakeCall([chunk_msg(0, 1), result_msg(finish=common_pb2.FINISH_REASON_ABORT)]))
    outs = asyncio.run(collect(flow))
    assert [o.finish_reason for o in outs] == ["abort"] and disagg.resolved == []
    assert disagg.log[-1] == "cancel res-r"


def test_an_abort_here_cancels_the_call_and_the_reservation() -> None:
    call = FakeCall([], hang=True)
    flow, _, disagg = flow_of(call)

    async def run() -> list[TokenOut]:
        task = asyncio.create_task(collect(flow))
        while not call.written:
            await asyncio.sleep(0.001)
        assert flow.abort("r") is True and flow.abort("other") is False
        return await task

    outs = asyncio.run(run())
    assert [o.finish_reason for o in outs] == ["abort"] and call.cancelled
    assert disagg.log[-1] == "cancel res-r" and disagg.resolved == []
    assert flow.abort("r") is False  # committed or gone: the scheduler's own abort applies


def test_an_invalid_request_fails_before_anything_is_reserved() -> None:
    flow, _, disagg = flow_of(FakeCall([]))

    async def run() -> None:
        async for _ in flow.generate("r", [], PARAMS, TARGET):
            pass

    with pytest.raises(RadixMeshError):
        asyncio.run(run())
    assert disagg.log == []
