"""The router over real gRPC and a real Redis, in front of model-free fake workers (fast)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
import pytest
import redis as sync_redis

from radixmesh.common.grpc_errors import from_rpc_error
from radixmesh.common.grpc_server import GrpcServerConfig
from radixmesh.index.redis_server import LocalRedis
from radixmesh.protocol import common_pb2, router_pb2, router_pb2_grpc, sampling_pb2, worker_pb2
from radixmesh.router.config import HealthConfig, MigrationConfig, RetryConfig, RouterConfig
from radixmesh.router.discovery.base import WorkerEndpoint
from radixmesh.router.discovery.static import StaticDiscovery
from radixmesh.router.server import RouterApp
from radixmesh.router.service import route_request
from radixmesh.wire.block_hash import block_hashes
from tests.fake_worker import BLOCK, FakeWorker
from tests.redis_helpers import local_redis  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration


@dataclass
class Cluster:
    workers: list[FakeWorker]
    apps: list[RouterApp]
    stubs: list[router_pb2_grpc.RouterServiceStub]
    channels: list[grpc.aio.Channel]


@contextlib.asynccontextmanager
async def cluster(num_workers: int = 2, policy: str = "cache-aware", redis_url: str | None = None,
                  num_routers: int = 1, **overrides: Any) -> AsyncIterator[Cluster]:
    if redis_url:
        sync_redis.Redis.from_url(redis_url).flushall()
    workers = [await FakeWorker(f"w{i}", redis_url).start() for i in range(num_workers)]
    endpoints = [WorkerEndpoint(w.address, w.address) for w in workers]
    apps, stubs, channels = [], [], []
    for _ in range(num_routers):
        config = RouterConfig(policy=policy, redis_url=redis_url, block_size=BLOCK, seed=1, redis_probe_s=0.2,
                              health=HealthConfig(interval_s=0.1, timeout_s=0.5),
                              retry=RetryConfig(max_attempts=3, base_backoff_s=0.01, max_backoff_s=0.02))
        config = dataclasses.replace(config, **overrides)
        app = RouterApp(GrpcServerConfig(port=0, metrics_port=-1, drain_timeout_s=1), config,
                        StaticDiscovery(endpoints))
        await app.start()
        apps.append(app)
        channel = grpc.aio.insecure_channel(app.server.address)
        channels.append(channel)
        stubs.append(router_pb2_grpc.RouterServiceStub(channel))
    deadline = time.monotonic() + 10
    while not all(len(a.registry.available()) == num_workers for a in apps):
        assert time.monotonic() < deadline, "workers never became healthy"
        await asyncio.sleep(0.02)
    try:
        yield Cluster(workers, apps, stubs, channels)
    finally:
        for channel in channels:
            await channel.close()
        for app in apps:
            await app.stop()
        for worker in workers:
            await worker.stop()


def request(ids: list[int], rid: str = "") -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=rid, token_ids=ids, block_hashes=common_pb2.BlockHashes(block_size=BLOCK,
                                                                           hashes=block_hashes(ids, BLOCK)),
        sampling_params=sampling_pb2.SamplingParams(max_new_tokens=3))


def group_prompt(group: int, member: int, prefix_blocks: int = 8) -> list[int]:
    return [group * 1000 + i for i in range(prefix_blocks * BLOCK)] + [500_000 + member * 100 + i for i in range(20)]


async def generate(stub: router_pb2_grpc.RouterServiceStub, ids: list[int],
                   rid: str = "") -> tuple[list[worker_pb2.GenerateResponse], common_pb2.RoutingInfo]:
    msgs = [m async for m in stub.Generate(request(ids, rid), timeout=10)]
    return msgs, msgs[0].routing


def test_proxies_the_stream_and_reports_the_decision() -> None:
    async def run() -> None:
        async with cluster(policy="round-robin") as c:
            msgs, routing = await generate(c.stubs[0], list(range(40)), rid="abc")
            assert [list(m.token_ids) for m in msgs] == [[0], [1], [2]]
            assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert routing.policy == "round-robin" and routing.attempt == 1
            assert routing.worker_id in {w.address for w in c.workers}
            assert {cand.worker_id for cand in routing.candidates} == {w.address for w in c.workers}
            assert not msgs[1].HasField("routing")
            listed = await c.stubs[0].ListWorkers(router_pb2.ListWorkersRequest())
            assert listed.policy == "round-robin" and len(listed.workers) == 2
            assert all(w.healthy and w.circuit_state == "closed" for w in listed.workers)
            load = await c.stubs[0].GetLoad(worker_pb2.GetLoadRequest())
            assert load.load.max_total_tokens == 20_000
            info = await c.stubs[0].GetModelInfo(worker_pb2.GetModelInfoRequest())
            assert info.model_name == "fake" and info.worker_id == ""
            assert (await c.stubs[0].FlushCache(worker_pb2.FlushCacheRequest())).flushed

    asyncio.run(run())


def test_retries_before_the_first_message_then_avoids_the_worker() -> None:
    async def run() -> None:
        async with cluster(policy="round-robin") as c:
            bad, good = c.workers
            bad.mode = "refuse"
            for i in range(4):
                msgs, routing = await generate(c.stubs[0], list(range(20)), rid=f"r{i}")
                assert routing.worker_id == good.address and len(msgs) == 3
            # The refusal marked it down at once; probes bring it back but it keeps refusing, and every
            # request it saw was retried on the other worker.
            assert 1 <= len(bad.requests) <= 4
            assert all(r.request_id.startswith("r") for r in bad.requests)

    asyncio.run(run())


def test_failure_after_the_first_message_ends_the_stream_with_an_error() -> None:
    """With migration off (or nowhere to migrate) a stream that broke after its first message fails."""
    async def run() -> None:
        async with cluster(num_workers=1, policy="round-robin", migration=MigrationConfig(enabled=False)) as c:
            c.workers[0].mode = "fail-mid"
            got: list[worker_pb2.GenerateResponse] = []
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for msg in c.stubs[0].Generate(request(list(range(20))), timeout=10):
                    got.append(msg)
            assert len(got) == 1, "the first message was forwarded, then the error; no retry"
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "failed mid-stream" in (from_rpc_error(info.value).message)
            assert len(c.workers[0].requests) == 1

    asyncio.run(run())


def test_abort_reaches_the_worker_running_the_sequence() -> None:
    async def run() -> None:
        async with cluster(policy="round-robin") as c:
            for w in c.workers:
                w.num_tokens, w.delay_s = 50, 0.02
            call = c.stubs[0].Generate(request(list(range(20)), rid="to-abort"), timeout=10)
            first = await call.read()
            assert first.token_ids == [0]
            reply = await c.stubs[0].Abort(worker_pb2.AbortRequest(request_id="to-abort"))
            assert reply.found
            rest = []
            while (msg := await call.read()) is not grpc.aio.EOF:
                rest.append(msg)
            assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT and len(rest) < 49
            assert not (await c.stubs[0].Abort(worker_pb2.AbortRequest(request_id="unknown"))).found

    asyncio.run(run())


def test_cache_aware_places_groups_on_their_prefix_and_spreads_new_prefixes(local_redis: LocalRedis) -> None:  # noqa: F811
    async def run() -> None:
        async with cluster(policy="cache-aware", redis_url=local_redis.url) as c:
            placement: dict[int, set[str]] = collections.defaultdict(set)
            cached = []
            for member in range(3):
                for group in range(4):  # one request at a time, groups interleaved
                    msgs, routing = await generate(c.stubs[0], group_prompt(group, member))
                    assert routing.policy == "cache-aware"
                    placement[group].add(routing.worker_id)
                    cached.append(msgs[0].cached_tokens)
            assert all(len(v) == 1 for v in placement.values()), placement
            assert collections.Counter(next(iter(v)) for v in placement.values()) == {
                c.workers[0].address: 2, c.workers[1].address: 2}
            assert cached[:4] == [0, 0, 0, 0] and all(n == 8 * BLOCK for n in cached[4:])

    asyncio.run(run())


def test_speculative_entries_keep_a_burst_of_a_new_prefix_together(local_redis: LocalRedis) -> None:  # noqa: F811
    async def run() -> None:
        async with cluster(policy="cache-aware", redis_url=local_redis.url) as c:
            for w in c.workers:
                w.delay_s = 0.05
            results = await asyncio.gather(*(generate(c.stubs[0], group_prompt(7, m)) for m in range(6)))
            assert len({routing.worker_id for _, routing in results}) == 1
            # Other routers learn the decision from the speculative entry, written just after it (off the request's
            # path): it names the chosen worker for the prefix's first block.
            first_block = block_hashes(group_prompt(7, 0), BLOCK)[0]
            spec = sync_redis.Redis.from_url(local_redis.url).get(f"radixmesh:spec:{first_block:016x}")
            assert spec is not None and spec.decode() == results[0][1].worker_id

    asyncio.run(run())


async def same_view(c: Cluster) -> None:
    """Until every block is in the index and each router's last poll found every worker idle: a load polled while
    a request ran would tip one router's choice and not the other's."""
    for w in c.workers:
        assert w.writer is not None and await w.writer.wait_published(10)
    deadline = time.monotonic() + 10
    while any(h.load.num_running_reqs for app in c.apps for h in app.registry.all()):
        assert time.monotonic() < deadline, "a router never saw the workers idle"
        await asyncio.sleep(0.02)


def test_two_routers_on_one_redis_make_the_same_choices(local_redis: LocalRedis) -> None:  # noqa: F811
    async def run() -> None:
        async with cluster(policy="cache-aware", redis_url=local_redis.url, num_routers=2) as c:
            await same_view(c)
            chosen: dict[int, list[str]] = collections.defaultdict(list)
            for member in range(4):
                for group in range(3):
                    first, second = c.stubs[member % 2], c.stubs[(member + 1) % 2]
                    _, r1 = await generate(first, group_prompt(group, member))
                    chosen[group].append(r1.worker_id)
                    _, r2 = await generate(second, group_prompt(group, member + 50))
                    chosen[group].append(r2.worker_id)
            assert all(len(set(v)) == 1 for v in chosen.values()), chosen
            # New prefixes asked of either router: the same (deterministic) choice.
            await same_view(c)
            for group in range(10, 14):
                route = route_request(request(group_prompt(group, 0)), BLOCK)
                d1 = await c.apps[0].router.select(route)
                d2 = await c.apps[1].router.select(route)
                assert d1.worker.worker_id == d2.worker.worker_id and d1.reason == d2.reason == "new-prefix"

    asyncio.run(run())


def test_redis_outage_switches_to_approx_tree_and_back(tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.redis_helpers import start_local_redis

    server = start_local_redis(tmp_path_factory.mktemp("redis-outage"))

    async def run() -> None:
        async with cluster(policy="cache-aware", redis_url=server.url) as c:
            _, routing = await generate(c.stubs[0], group_prompt(1, 0))
            assert routing.policy == "cache-aware"
            home = routing.worker_id
            server.stop()
            _, routing = await generate(c.stubs[0], group_prompt(1, 1))
            assert routing.policy == "approx-tree", "Redis is down: the fallback decides"
            assert routing.worker_id == home, "the fallback tree was kept warm by earlier decisions"
            listed = await c.stubs[0].ListWorkers(router_pb2.ListWorkersRequest())
            assert listed.policy == "approx-tree"
            server.start()
            deadline = time.monotonic() + 10
            while (await c.stubs[0].ListWorkers(router_pb2.ListWorkersRequest())).policy != "cache-aware":
                assert time.monotonic() < deadline, "the router never went back to cache-aware"
                await asyncio.sleep(0.1)
            for w in c.workers:
                assert w.writer is not None and await w.writer.wait_published(10)
            _, routing = await generate(c.stubs[0], group_prompt(1, 2))
            assert routing.policy == "cache-aware" and routing.worker_id == home

    try:
        asyncio.run(run())
    finally:
        server.stop()
