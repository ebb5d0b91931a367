"""The router's endpoint picker over real gRPC and a real Redis index, in front of model-free fake workers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis as sync_redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixmesh.common.grpc_server import GrpcServerConfig
from radixmesh.index.redis_server import LocalRedis
from radixmesh.router.config import HealthConfig, RouterConfig
from radixmesh.router.discovery.base import WorkerEndpoint
from radixmesh.router.discovery.static import StaticDiscovery
from radixmesh.router.epp.config import EppConfig
from radixmesh.router.epp.server import EXT_PROC_SERVICE
from radixmesh.router.server import RouterApp
from radixmesh.wire.block_hash import block_hashes
from tests.epp_client import PickerClient
from tests.fake_worker import BLOCK, FakeWorker
from tests.redis_helpers import local_redis  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration


@dataclass
class Pool:
    workers: list[FakeWorker]
    app: RouterApp
    client: PickerClient

    def endpoint(self, worker: FakeWorker) -> str:
        return f"127.0.0.1:{worker.http_port}"

    def worker_at(self, endpoint: str) -> FakeWorker:
        return next(w for w in self.workers if self.endpoint(w) == endpoint)


@contextlib.asynccontextmanager
async def pool(redis_url: str | None = None, num_workers: int = 2, http: bool = True,
               probe_interval_s: float = 0.1, **epp: object) -> AsyncIterator[Pool]:
    if redis_url:
        sync_redis.Redis.from_url(redis_url).flushall()
    workers = [await FakeWorker(f"w{i}", redis_url).start() for i in range(num_workers)]
    for i, worker in enumerate(workers):
        worker.http_port = 18_000 + i if http else 0  # reported only: a picker never dials it
    config = RouterConfig(policy="cache-aware", redis_url=redis_url, block_size=BLOCK, seed=1,
                          health=HealthConfig(interval_s=probe_interval_s, timeout_s=0.5))
    app = RouterApp(GrpcServerConfig(port=0, metrics_port=-1, drain_timeout_s=1), config,
                    StaticDiscovery([WorkerEndpoint(w.address, w.address) for w in workers]),
                    epp=EppConfig(port=0, **epp))  # type: ignore[arg-type]
    await app.start()
    assert app.epp is not None
    deadline = time.monotonic() + 10
    while len(app.registry.available()) < num_workers or (http and len(app.epp.picker.candidates()) < num_workers):
        assert time.monotonic() < deadline, "workers never became ready"
        await asyncio.sleep(0.02)
    client = PickerClient(f"127.0.0.1:{app.epp.port}")
    try:
        yield Pool(workers, app, client)
    finally:
        await client.close()
        await app.stop()
        for worker in workers:
            await worker.stop()


def group_prompt(group: int, member: int, prefix_blocks: int = 6) -> list[int]:
    return [group * 1000 + i for i in range(prefix_blocks * BLOCK)] + [500 + member * 10 + i for i in range(7)]


async def publish(worker: FakeWorker, ids: list[int]) -> None:
    assert worker.writer is not None
    worker.writer.stored(block_hashes(ids, BLOCK))
    await worker.writer.wait_published()


def test_picks_the_worker_whose_index_entries_hold_the_prefix(local_redis: LocalRedis) -> None:  # noqa: F811
    async def run() -> None:
        async with pool(local_redis.url) as p:
            for group, holder in ((7, p.workers[1]), (8, p.workers[0]), (9, p.workers[1])):
                await publish(holder, group_prompt(group, 0))  # as a worker does once it cached the prompt
                answer, _ = await p.client.pick({"model": "m", "prompt": group_prompt(group, 1)})
                assert answer.status == 0
                assert answer.header == answer.metadata == p.endpoint(holder), (group, answer)
            decisions = {(s.labels["reason"], s.value) for m in _router_decisions() for s in m.samples
                         if s.name.endswith("_total") and s.value}
            assert any(reason == "cache-hit" for reason, _ in decisions), decisions

    asyncio.run(run())


def _router_decisions() -> list[Any]:
    from prometheus_client import REGISTRY

    return [m for m in REGISTRY.collect() if m.name == "radixmesh_router_decisions"]


def test_a_burst_of_one_new_prefix_goes_to_one_worker_and_counts_in_flight(local_redis: LocalRedis) -> None:  # noqa: F811
    async def run() -> None:
        async with pool(local_redis.url, num_workers=3) as p:
            calls, endpoints = [], set()
            for member in range(4):
                answer, call = await p.client.pick({"prompt": group_prompt(3, member)}, keep_open=True)
                endpoints.add(answer.header)
                calls.append(call)
            assert len(endpoints) == 1, endpoints  # this picker's recent decisions cover the burst
            chosen = p.app.registry.get(p.worker_at(str(endpoints.pop())).address)
            assert chosen is not None and chosen.num_inflight == 4  # the streams stay open while requests run
            for call in calls:
                call.cancel()  # the proxy is done with the requests
            deadline = time.monotonic() + 5
            while chosen.num_inflight:
                assert time.monotonic() < deadline, "in-flight picks were never released"
                await asyncio.sleep(0.02)

    asyncio.run(run())


def test_subset_hint_and_fallbacks(local_redis: LocalRedis) -> None:  # noqa: F811
    async def run() -> None:
        async with pool(local_redis.url, num_workers=3, fallbacks=2) as p:
            w0, w1, w2 = p.workers
            answer, _ = await p.client.pick({"prompt": group_prompt(1, 0)})
            listed = answer.header.split(",") if answer.header else []
            assert answer.header == answer.metadata and sorted(listed) == sorted(map(p.endpoint, p.workers))
            for allowed in ([w2], [w0, w2]):
                await publish(w1, group_prompt(4, 0))  # w1 holds the prefix but is outside the subset
                answer, _ = await p.client.pick({"prompt": group_prompt(4, 1)}, subset=[p.endpoint(w) for w in allowed])
                assert answer.header is not None
                assert set(answer.header.split(",")) == {p.endpoint(w) for w in allowed}, answer.header
            for subset in ([], ["10.9.9.9:8000"]):
                answer, _ = await p.client.pick({"prompt": group_prompt(4, 2)}, subset=subset)
                assert answer.status == 503 and answer.header is None and answer.metadata is None
                assert "subset" in answer.error()["message"] and answer.error()["type"] == "server_error"

    asyncio.run(run())


def test_requests_without_a_body_or_prompt_are_picked_by_load() -> None:
    async def run() -> None:
        async with pool(None) as p:
            endpoints = set(map(p.endpoint, p.workers))
            get, _ = await p.client.pick(None, path="/v1/models")
            assert get.response.WhichOneof("response") == "request_headers" and get.header in endpoints
            for body in (b"not json", {"model": "m"}, {"messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "data:,"}}]}]}):
                answer, _ = await p.client.pick(body)
                assert answer.header in endpoints and answer.header == answer.metadata

    asyncio.run(run())


def test_503_without_workers_serving_http_and_health_follows() -> None:
    async def run() -> None:
        async with pool(None, http=False) as p:
            answer, _ = await p.client.pick({"prompt": [1, 2, 3]})
            assert answer.status == 503 and "--http-port" in answer.error()["message"]
            health = health_pb2_grpc.HealthStub(p.client.channel)
            for service, want in (("", "NOT_SERVING"), (EXT_PROC_SERVICE, "NOT_SERVING"), ("liveness", "SERVING")):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status) == want, service
            for worker in p.workers:
                worker.http_port = 18_100 + p.workers.index(worker)
            deadline = time.monotonic() + 5
            while (await health.Check(health_pb2.HealthCheckRequest(service=""))).status != \
                    health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, "the picker never became ready"
                await asyncio.sleep(0.05)
            answer, _ = await p.client.pick({"prompt": [1, 2, 3]})
            assert answer.status == 0 and answer.header.startswith("127.0.0.1:181")  # type: ignore[union-attr]

    asyncio.run(run())


def test_sheds_with_429_once_every_worker_has_its_queue_full() -> None:
    async def run() -> None:
        # Probes every 60 s: the load each worker reported at start stays, so picks since it count as waiting.
        async with pool(None, probe_interval_s=60.0, max_queue_per_worker=2) as p:
            assert p.app.epp is not None
            picker = p.app.epp.picker
            statuses = []
            for i in range(20):
                answer, _ = await p.client.pick({"prompt": [5, 6, 7, i]})
                statuses.append(answer.status)
                if answer.status:
                    break
            assert statuses[-1] == 429 and set(statuses[:-1]) == {0} and len(statuses) >= 5, statuses
            assert answer.error()["type"] == "rate_limit_error"
            assert all(picker.queued(w) >= 2 for w in p.app.registry.all())

    asyncio.run(run())


@pytest.mark.parametrize("waiting", [0, 3])
def test_reported_queues_count_toward_shedding(waiting: int) -> None:
    async def run() -> None:
        async with pool(None, max_queue_per_worker=3) as p:
            for worker in p.workers:
                worker.num_waiting = waiting
            await asyncio.sleep(0.3)  # a few probes: the reports carry the queues
            answer, _ = await p.client.pick({"prompt": [1, 2, 3]})
            assert answer.status == (429 if waiting >= 3 else 0)

    asyncio.run(run())
