"""gateway/failover.relay over scripted replicas: which breaks move a stream to another router replica, what the
next replica is asked for, and when the stream's error is final."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc.aio
import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.gateway.failover import MAX_FAILOVERS, StreamBroke, may_fail_over, relay, retry_request
from radixmesh.protocol import sampling_pb2, worker_pb2


def request(max_new_tokens: int = 10, **fields: Any) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id="r", token_ids=[1, 2], sampling_params=sampling_pb2.SamplingParams(
        max_new_tokens=max_new_tokens), **fields)


def response(*ids: int, finish: int = 0) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(request_id="leg", token_ids=list(ids), finish_reason=finish)


class Call:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Replicas:
    """Each open gives the next script: messages, then EOF or an error raised on the read after them."""

    def __init__(self, *scripts: tuple[list[Any], RadixMeshError | None]) -> None:
        self.scripts = list(scripts)
        self.opened: list[worker_pb2.GenerateRequest] = []
        self.calls: list[Call] = []
        self.targets: list[tuple[Any, str]] = []
        self.open_error: RadixMeshError | None = None

    async def open(self, req: worker_pb2.GenerateRequest) -> tuple[Any, Any, Any, str]:
        self.opened.append(req)
        if not self.scripts:
            raise self.open_error or RadixMeshError(ErrorCode.UNAVAILABLE, "no ready router replica")
        msgs, error = self.scripts.pop(0)
        call = Call()
        self.calls.append(call)
        state = {"msgs": list(msgs), "error": error}
        first = state["msgs"].pop(0) if state["msgs"] else self._end(state)
        return state, call, first, req.request_id

    @staticmethod
    def _end(state: dict[str, Any]) -> Any:
        if state["error"] is not None:
            raise state["error"]
        return grpc.aio.EOF

    async def read(self, target: Any, call: Any) -> Any:
        return target["msgs"].pop(0) if target["msgs"] else self._end(target)

    def on_target(self, target: Any, leg_id: str) -> None:
        self.targets.append((target, leg_id))


def run(replicas: Replicas, req: worker_pb2.GenerateRequest, can_fail_over: bool = True) -> list[list[int]]:
    async def collect() -> list[list[int]]:
        return [list(m.token_ids) async for m in relay(req, replicas.open, replicas.read, replicas.on_target,
                                                        can_fail_over)]
    return asyncio.run(collect())


def test_retry_request_keeps_the_first_try_and_renames_later_ones() -> None:
    req = request()
    assert retry_request(req, 0) is req
    retry = retry_request(req, 2)
    assert retry.request_id == "r~r2" and list(retry.token_ids) == [1, 2] and req.request_id == "r"


def test_only_broken_or_draining_replicas_may_fail_over() -> None:
    assert may_fail_over(StreamBroke("connection reset"))
    assert may_fail_over(RadixMeshError(ErrorCode.DRAINING, "draining"))
    assert not may_fail_over(RadixMeshError(ErrorCode.UNAVAILABLE, "the worker failed"))
    assert not may_fail_over(RadixMeshError(ErrorCode.INVALID_ARGUMENT, "bad"))


def test_a_whole_stream_from_one_replica_is_relayed_as_the_requests_own() -> None:
    replicas = Replicas(([response(5), response(6, finish=1)], None))
    out: list[worker_pb2.GenerateResponse] = []

    async def collect() -> None:
        async for msg in relay(request(), replicas.open, replicas.read, replicas.on_target, True):
            out.append(msg)
    asyncio.run(collect())
    assert [list(m.token_ids) for m in out] == [[5], [6]] and {m.request_id for m in out} == {"r"}
    assert replicas.targets[0][1] == "r" and replicas.calls[0].cancelled


def test_a_broken_stream_resumes_on_another_replica_from_the_tokens_sent() -> None:
    replicas = Replicas(([response(5), response(6)], StreamBroke("reset")),
                        ([response(7, finish=1)], None))
    assert run(replicas, request()) == [[5], [6], [7]]
    resumed = replicas.opened[1]
    assert resumed.request_id == "r~g1" and list(resumed.resume_output_ids) == [5, 6]
    assert [leg for _, leg in replicas.targets] == ["r", "r~g1"]
    assert all(call.cancelled for call in replicas.calls)


def test_a_draining_replica_hands_the_stream_on() -> None:
    replicas = Replicas(([response(5)], RadixMeshError(ErrorCode.DRAINING, "drained")),
                        ([response(6, finish=1)], None))
    assert run(replicas, request()) == [[5], [6]]


def test_a_replicas_own_error_is_final() -> None:
    replicas = Replicas(([response(5)], RadixMeshError(ErrorCode.UNAVAILABLE, "worker failed; not moved")),
                        ([response(6)], None))
    with pytest.raises(RadixMeshError, match="not moved"):
        run(replicas, request())
    assert len(replicas.opened) == 1


def test_without_failover_a_break_is_final() -> None:
    replicas = Replicas(([response(5)], StreamBroke("reset")), ([response(6)], None))
    with pytest.raises(StreamBroke):
        run(replicas, request(), can_fail_over=False)
    assert len(replicas.opened) == 1


def test_a_stream_that_used_its_token_budget_is_not_resumed() -> None:
    replicas = Replicas(([response(5), response(6)], StreamBroke("reset")), ([response(7)], None))
    with pytest.raises(StreamBroke):
        run(replicas, request(max_new_tokens=2))
    assert len(replicas.opened) == 1


def test_a_prefill_only_stream_is_not_resumed() -> None:
    replicas = Replicas(([response(5)], StreamBroke("reset")), ([response(7)], None))
    with pytest.raises(StreamBroke):
        run(replicas, request(prefill_only=True))


def test_failovers_stop_after_the_limit() -> None:
    scripts = [([response(i)], StreamBroke(f"reset {i}")) for i in range(MAX_FAILOVERS + 2)]
    replicas = Replicas(*scripts)
    with pytest.raises(StreamBroke, match=f"reset {MAX_FAILOVERS}"):
        run(replicas, request())
    assert len(replicas.opened) == MAX_FAILOVERS + 1
    assert replicas.opened[-1].request_id == f"r~g{MAX_FAILOVERS}"


def test_no_other_replica_names_both_the_break_and_why() -> None:
    replicas = Replicas(([response(5)], StreamBroke("connection reset")))
    with pytest.raises(RadixMeshError) as err:
        run(replicas, request())
    assert err.value.code is ErrorCode.UNAVAILABLE
    assert "connection reset" in err.value.message and "no ready router replica" in err.value.message


def test_an_open_that_fails_first_is_the_requests_error_as_it_is() -> None:
    replicas = Replicas()
    replicas.open_error = RadixMeshError(ErrorCode.RESOURCE_EXHAUSTED, "queue full")
    with pytest.raises(RadixMeshError) as err:
        run(replicas, request())
    assert err.value.code is ErrorCode.RESOURCE_EXHAUSTED and err.value.message == "queue full"
    opening = Replicas(([], StreamBroke("reset")), ([response(9)], None))  # broke before its first message
    with pytest.raises(StreamBroke):
        run(opening, request())  # the opener's own retries cover that; the relay adds none
    assert len(opening.opened) == 1


def test_a_break_before_any_token_retries_the_request_itself() -> None:
    replicas = Replicas(([response()], StreamBroke("reset")), ([response(9, finish=1)], None))
    assert run(replicas, request()) == [[], [9]]
    assert replicas.opened[1].request_id == "r" and not replicas.opened[1].resume_output_ids
