"""The cluster gateway's Generate upstream (gateway/generate_upstream.py) over stand-in replicas: failover before a
stream starts, errors after it started, aborts and control calls."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.gateway.generate_upstream import GenerateUpstream, carries_error, unreachable

from .upstream_fakes import FakeCall, FakeReplica, RpcFailure, drain, generation, request, response


def test_a_stream_comes_from_the_first_ready_replica_and_is_tracked_for_aborts() -> None:
    call = FakeCall([response(1), response(2)])
    first, second = FakeReplica("a:1", call), FakeReplica("b:1", up=False)
    gen, _ = generation(first, second)

    async def run() -> list[Any]:
        out = []
        async for msg in gen.stream(request("r")):
            assert gen.inflight["r"] is first  # while it streams, an abort goes here
            out.append(msg)
        return out

    assert [list(m.token_ids) for m in asyncio.run(run())] == [[1], [2]]
    assert "r" not in gen.inflight and call.cancelled and first.log == ["generate r"] and second.log == []


def test_an_unreachable_replica_before_the_first_message_is_skipped_and_marked_down() -> None:
    dead = FakeReplica("a:1", FakeCall([], fail_after=0, error=RpcFailure(grpc.StatusCode.UNAVAILABLE, "gone")))
    alive = FakeReplica("b:1", FakeCall([response(7)]))
    gen, watcher = generation(dead, alive)
    assert [list(m.token_ids) for m in asyncio.run(drain(gen))] == [[7]]
    assert watcher.down == ["a:1"] and dead.call.cancelled
    assert alive.log == ["generate r~r1"]  # a retry runs under an id of its own (the first try may still run)


def test_a_replicas_own_error_before_the_first_message_is_the_requests() -> None:
    bad = FakeReplica("a:1", FakeCall([], fail_after=0, error=RpcFailure(grpc.StatusCode.INVALID_ARGUMENT,
                                                                        "top_p out of range", own=True)))
    other = FakeReplica("b:1", FakeCall([response(7)]))
    gen, watcher = generation(bad, other)
    with pytest.raises(RadixMeshError) as info:
        asyncio.run(drain(gen))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and other.log == [] and watcher.down == []


def test_with_every_replica_gone_the_error_names_what_is_missing() -> None:
    dead = FakeReplica("a:1", FakeCall([], fail_after=0, error=RpcFailure(grpc.StatusCode.UNAVAILABLE, "gone")))
    gen, _ = generation(dead, reason="no router answers")
    with pytest.raises(RadixMeshError) as info:
        asyncio.run(drain(gen))
    assert info.value.code is ErrorCode.UNAVAILABLE and info.value.message == "no router answers"


def test_a_stream_that_breaks_after_it_started_with_no_other_replica_is_unavailable() -> None:
    broken = FakeReplica("a:1", FakeCall([response(1)], fail_after=1,
                                         error=RpcFailure(grpc.StatusCode.UNAVAILABLE, "reset")))
    gen, watcher = generation(broken)
    got: list[Any] = []

    async def run() -> None:
        async for msg in gen.stream(request()):
            got.append(msg)

    with pytest.raises(RadixMeshError) as info:
        asyncio.run(run())
    assert info.value.code is ErrorCode.UNAVAILABLE and "broke after it started" in info.value.message
    assert len(got) == 1 and watcher.down == ["a:1"]


def test_a_stream_that_breaks_after_it_started_continues_on_another_replica() -> None:
    broken = FakeReplica("a:1", FakeCall([response(1)], fail_after=1,
                                         error=RpcFailure(grpc.StatusCode.UNAVAILABLE, "reset")))
    spare = FakeReplica("b:1", FakeCall([response(9)]))
    gen, watcher = generation(broken, spare)
    got = asyncio.run(drain(gen))
    assert [list(m.token_ids) for m in got] == [[1], [9]] and all(m.request_id == "r" for m in got)
    assert spare.log == ["generate r~g1"] and watcher.down == ["a:1"]  # the leg resumes from token 1 under its id
    assert not gen.inflight and not gen.legs


def test_a_targets_own_error_mid_stream_comes_through_as_it_is() -> None:
    failing = FakeReplica("a:1", FakeCall([response(1)], fail_after=1,
                                          error=RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, "KV full", own=True)))
    gen, watcher = generation(failing)
    with pytest.raises(RadixMeshError) as info:
        asyncio.run(drain(gen))
    assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED and watcher.down == []


def test_aborts_go_to_the_replica_running_the_request_or_to_every_ready_one() -> None:
    a, b, down = FakeReplica("a:1"), FakeReplica("b:1"), FakeReplica("c:1", up=False)
    gen, _ = generation(a, b, down)
    gen.inflight["known"] = b  # type: ignore[assignment]
    asyncio.run(gen.abort("known"))
    asyncio.run(gen.abort("unknown"))
    assert a.log == ["abort unknown"] and b.log == ["abort known", "abort unknown"] and down.log == []


def test_control_calls_go_to_a_ready_replica() -> None:
    gen, _ = generation(FakeReplica("a:1", up=False), FakeReplica("b:1"))
    load = asyncio.run(gen.load())
    assert (load.num_running_reqs, load.kv_usage) == (2, 0.5)
    assert asyncio.run(gen.flush_cache()) is True
    nobody, _ = generation(FakeReplica("a:1", up=False), reason="starting")
    with pytest.raises(RadixMeshError, match="starting"):
        nobody.control_target()


def test_one_worker_only() -> None:
    with pytest.raises(RadixMeshError) as info:
        GenerateUpstream("127.0.0.1:1,127.0.0.1:2", "worker", lambda: "")
    assert info.value.param == "worker"


def test_transport_failures_and_service_errors_are_told_apart() -> None:
    assert unreachable(RpcFailure(grpc.StatusCode.UNAVAILABLE))
    assert unreachable(RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED))
    assert not unreachable(RpcFailure(grpc.StatusCode.UNAVAILABLE, own=True))  # the service said so itself
    assert not unreachable(RpcFailure(grpc.StatusCode.INTERNAL))
    assert carries_error(RpcFailure(grpc.StatusCode.INTERNAL, own=True))
