"""Readiness from named dependencies, and the gRPC health status and reason that follow it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixmesh.common.errors import RadixMeshError
from radixmesh.common.grpc_server import (
    LIVENESS_SERVICE,
    GrpcServer,
    GrpcServerConfig,
    _first_line,
    check_peer_health,
)
from radixmesh.common.readiness import Readiness
from radixmesh.gateway.upstreams import Upstream, UpstreamGroup, parse_addresses
from radixmesh.protocol import router_pb2_grpc


def test_ready_when_every_required_dependency_is_up() -> None:
    readiness = Readiness("svc")
    assert readiness.ready and readiness.reason == "" and readiness.summary() == "ready"
    readiness.add("router", "the router at 10.0.0.1:1")
    readiness.add("redis", "the index at redis://x", required=False)
    assert not readiness.ready
    assert readiness.reason == "waiting for the router at 10.0.0.1:1 (not contacted yet)"
    readiness.set("router", False, "not reachable: connection refused")
    assert readiness.reason == "waiting for the router at 10.0.0.1:1 (not reachable: connection refused)"
    readiness.set("router", True)
    assert readiness.ready and readiness.reason == ""
    assert [d.name for d in readiness.degraded] == ["redis"]
    assert readiness.summary().startswith("ready, degraded: the index at redis://x unavailable")
    readiness.set("redis", True)
    assert readiness.summary() == "ready"


def test_reason_names_every_missing_dependency_and_listeners_see_changes() -> None:
    readiness = Readiness("gateway")
    seen: list[bool] = []
    readiness.on_change(lambda r: seen.append(r.ready))
    readiness.add("tokenizer", "the tokenizer at a:1")
    readiness.add("router", "the router at b:2")
    assert "the tokenizer at a:1" in readiness.reason and "the router at b:2" in readiness.reason
    readiness.set("tokenizer", True)
    readiness.set("tokenizer", True, "still up")  # no change of state: no call
    readiness.set("router", True)
    assert seen == [True, False, False, False, True]


def test_each_state_change_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    readiness = Readiness("svc")
    readiness.add("router", "the router at b:2", up=True)
    with caplog.at_level(logging.WARNING, logger="radixmesh.common.readiness"):
        for _ in range(3):
            readiness.set("router", False, "connection refused")
        readiness.set("router", True)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["svc: the router at b:2 is unavailable: connection refused", "svc: the router at b:2 answers"]


def test_grpc_connect_failures_read_short() -> None:
    detail = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:5: "
              "Failed to connect to remote host: Connection refused")
    assert _first_line(detail) == "connection refused"
    assert _first_line("Deadline Exceeded") == "Deadline Exceeded"


def test_health_follows_readiness_with_the_reason_and_liveness_stays_serving() -> None:
    async def run() -> None:
        server = GrpcServer(GrpcServerConfig(port=0, metrics_port=-1), "svc", ["radixmesh.v1.RouterService"])
        server.readiness.add("workers", "a healthy worker", detail="no worker discovered yet")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                up, detail = await check_peer_health(health, 5)
                assert not up and detail == "NOT_SERVING: waiting for a healthy worker (no worker discovered yet)"
                assert (await check_peer_health(health, 5, "radixmesh.v1.RouterService"))[0] is False
                assert await check_peer_health(health, 5, LIVENESS_SERVICE) == (True, "")
                server.readiness.set("workers", True, "1 of 1 workers healthy")
                for _ in range(100):
                    if (await check_peer_health(health, 5))[0]:
                        break
                    await asyncio.sleep(0.01)
                assert await check_peer_health(health, 5) == (True, "")
                reply = await health.Check(health_pb2.HealthCheckRequest(service="radixmesh.v1.RouterService"))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.server.stop(0)

    asyncio.run(run())


def test_an_address_where_nothing_listens_is_not_reachable() -> None:
    async def run() -> None:
        from tests.ports import free_port

        async with grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}") as channel:
            up, detail = await check_peer_health(health_pb2_grpc.HealthStub(channel), 5)
        assert not up and detail.startswith("not reachable")

    asyncio.run(run())


def test_router_replicas_parse_and_rotate() -> None:
    assert parse_addresses("a:1, b:2", "router") == ["a:1", "b:2"]
    for bad in ("", "a:1,a:1", "nohost", "a:0", "a:x"):
        with pytest.raises(RadixMeshError):
            parse_addresses(bad, "router")

    async def run() -> None:
        group = UpstreamGroup("router", [Upstream("router", a, router_pb2_grpc.RouterServiceStub)
                                         for a in ("a:1", "b:2", "c:3")])
        try:
            assert group.description == "a router at a:1 or b:2 or c:3" and not group.up
            assert group.ready() == []
            for u in group.upstreams[:2]:
                u.up = True
            firsts = {group.ready()[0].address for _ in range(4)}
            assert firsts == {"a:1", "b:2"}, "requests go to the ready replicas in turn"
            assert all(len(group.ready()) == 2 for _ in range(3))
        finally:
            for u in group.upstreams:
                await u.close()

    asyncio.run(run())


def test_grammar_cache_without_redis_is_a_miss_logged_once_and_probed_again(caplog: pytest.LogCaptureFixture) -> None:
    from radixmesh.grammar_service.store import GrammarStore, StoreConfig
    from tests.ports import free_port

    async def run() -> None:
        store = GrammarStore(StoreConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0", redis_timeout_s=1))
        with caplog.at_level(logging.WARNING, logger="radixmesh.grammar_service.store"):
            assert await store.get("k") is None and not store.redis_up
            await store.put("k", b"compiled")  # skipped while Redis is down, kept in memory
            assert await store.get("k") == (b"compiled", "memory")
            assert await store.probe() is False
        assert len(caplog.records) == 1 and "Redis unavailable" in caplog.records[0].getMessage()
        assert store.redis_error
        await store.close()

    asyncio.run(run())


def test_worker_reports_a_missing_index_and_grammar_service_as_degraded_not_unready() -> None:
    from types import SimpleNamespace

    from radixmesh.worker.server import _watch_optional
    from tests.ports import free_port

    class DeadRedis:
        async def ping(self) -> None:
            raise ConnectionError("connection refused")

    async def run() -> None:
        server = GrpcServer(GrpcServerConfig(port=0, metrics_port=-1), "worker", [])
        server.readiness.add("engine", "the scheduler process", up=True)
        publisher: Any = SimpleNamespace(redis=DeadRedis(), config=SimpleNamespace(redis_url="redis://x:1"))
        task = asyncio.create_task(_watch_optional(server, publisher, f"127.0.0.1:{free_port()}"))
        try:
            for _ in range(200):
                if "grammar" in server.readiness and server.readiness.get("grammar").detail != "not contacted yet":
                    break
                await asyncio.sleep(0.02)
            assert server.readiness.ready, "a worker serves without its index and grammar service"
            assert {d.name for d in server.readiness.degraded} == {"index", "grammar"}
            assert "connection refused" in server.readiness.get("index").detail
            assert server.readiness.get("grammar").detail.startswith("not reachable")
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(run())
