"""Generate over the lanes: gateway -> router -> worker with both hops on plain TCP, the gRPC transport kept
where asked for, and the fallbacks (a lane that cannot be reached, a caller that leaves, a router that dies)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.common.grpc_server import GrpcServer, GrpcServerConfig
from radixmesh.common.lane import LaneClient
from radixmesh.gateway.cluster_backend import ClusterBackend
from radixmesh.protocol import worker_pb2
from radixmesh.router.config import HealthConfig, RetryConfig, RouterConfig
from radixmesh.router.discovery.base import WorkerEndpoint
from radixmesh.router.discovery.static import StaticDiscovery
from radixmesh.router.server import RouterApp
from radixmesh.wire.sampling import SamplingParams
from tests.fake_worker import FakeWorker
from tests.integration.test_start_order import FAST_WATCH, generate_text, start_tokenizer, wait_until

pytestmark = pytest.mark.integration


async def start_router(workers: list[FakeWorker], transport: str = "lane", lane_port: int = 0) -> RouterApp:
    config = RouterConfig(policy="round-robin", generate_transport=transport,
                          health=HealthConfig(interval_s=0.1, timeout_s=0.5),
                          retry=RetryConfig(max_attempts=2, base_backoff_s=0.01, max_backoff_s=0.02))
    app = RouterApp(GrpcServerConfig(port=0, metrics_port=-1, drain_timeout_s=0.5, lane_port=lane_port), config,
                    StaticDiscovery([WorkerEndpoint(w.address, w.address) for w in workers]))
    await app.start()
    return app


@contextlib.asynccontextmanager
async def services(router_transport: str = "lane", gateway_transport: str = "lane", worker_lane: bool = True,
                   router_lane_port: int = 0) -> AsyncIterator[tuple[ClusterBackend, RouterApp, FakeWorker]]:
    """A fake worker, a real router and a gateway backend over a fake tokenizer, ready to serve."""
    worker = await FakeWorker("w0", lane=worker_lane).start()
    tokenizer: GrpcServer = await start_tokenizer(0)
    router = await start_router([worker], router_transport, router_lane_port)
    assert router.server is not None
    backend = await ClusterBackend.start(tokenizer.address, router.server.address, watch=FAST_WATCH,
                                      transport=gateway_transport)
    try:
        assert await backend.wait_ready(20), backend.not_ready_reason()
        await wait_until(lambda: router.registry.available() != [], 10, "the worker healthy")
        yield backend, router, worker
    finally:
        await backend.close()
        await router.stop()
        await tokenizer.stop()
        await worker.stop()


def lane_of(router: RouterApp) -> LaneClient | None:
    """The connection the router uses for its worker's lane (None: Generate over gRPC)."""
    (handle,) = router.registry.all()
    return handle.client.lane.client if handle.client.lane is not None else None


def gateway_lane(backend: ClusterBackend) -> LaneClient | None:
    """The connection the gateway uses for its router's lane (None: Generate over gRPC)."""
    lane = backend.targets.upstreams[0].lane
    return lane.client if lane is not None else None


async def lanes_learnt(backend: ClusterBackend, router: RouterApp) -> None:
    await wait_until(lambda: lane_of(router) is not None, 10, "the router to learn the worker's lane")
    await wait_until(lambda: gateway_lane(backend) is not None, 10, "the gateway to learn the router's")


def test_both_hops_on_lanes_and_the_ports_are_reported() -> None:
    async def run() -> None:
        async with services() as (backend, router, worker):
            assert router.server is not None and router.server.lane_port > 0
            load = await backend.targets.upstreams[0].stub.GetLoad(worker_pb2.GetLoadRequest())
            assert load.lane_port == router.server.lane_port
            await lanes_learnt(backend, router)
            assert await generate_text(backend, [1, 2, 3]) == "<0><1><2>"
            assert worker.transports[-1] == "lane"
            assert gateway_lane(backend) is not None and gateway_lane(backend).port == router.server.lane_port  # type: ignore[union-attr]

    asyncio.run(run())


def test_grpc_transport_when_asked_for_or_when_a_peer_has_no_lane() -> None:
    async def run() -> None:
        async with services(router_transport="grpc", gateway_transport="grpc") as (backend, router, worker):
            assert await generate_text(backend, [1, 2, 3]) == "<0><1><2>"
            assert worker.transports == ["grpc"]
            assert lane_of(router) is None and gateway_lane(backend) is None
        async with services(worker_lane=False, router_lane_port=-1) as (backend, router, worker):
            assert router.server is not None and router.server.lane_port == 0
            await asyncio.sleep(0.3)  # several probes and checks: nothing to learn
            assert await generate_text(backend, [1, 2, 3]) == "<0><1><2>"
            assert worker.transports == ["grpc"]
            assert lane_of(router) is None and gateway_lane(backend) is None

    asyncio.run(run())


def test_a_lane_that_cannot_be_reached_falls_back_to_grpc_for_the_same_request() -> None:
    async def run() -> None:
        async with services() as (backend, router, worker):
            await lanes_learnt(backend, router)
            assert worker.server.lane is not None and router.server is not None and router.server.lane is not None
            await worker.server.lane.close()  # the ports still reported, nothing listening there
            await router.server.lane.close()
            for _ in range(3):
                assert await generate_text(backend, [1, 2, 3]) == "<0><1><2>"
            assert worker.transports[-3:] == ["grpc"] * 3
            assert lane_of(router) is None, "a refused lane is not learnt again from the same port"
            assert gateway_lane(backend) is None

    asyncio.run(run())


def test_a_caller_leaving_a_lane_stream_ends_the_workers_request() -> None:
    async def run() -> None:
        async with services() as (backend, router, worker):
            await lanes_learnt(backend, router)
            worker.mode = "hang-mid"
            stream = backend.generate([1, 2, 3], SamplingParams(max_new_tokens=3), rid="leave")
            first = await stream.__anext__()
            assert first.text == "<0>" and "leave" in worker.running
            await stream.aclose()
            await wait_until(lambda: "leave" not in worker.running, 10, "the worker's handler to end")
            await wait_until(lambda: router.router.inflight.get("leave") is None, 10, "the router to forget it")
            assert worker.transports == ["lane"]

    asyncio.run(run())


def test_a_worker_error_crosses_both_lanes_as_it_was_raised() -> None:
    async def run() -> None:
        async with services() as (backend, router, worker):
            await lanes_learnt(backend, router)
            worker.mode = "fail-mid"
            stream = backend.generate([1, 2, 3], SamplingParams(max_new_tokens=3), rid="fails")
            assert (await stream.__anext__()).text == "<0>"
            with pytest.raises(RadixMeshError) as err:
                await stream.__anext__()
            assert err.value.code is ErrorCode.UNAVAILABLE and "w0 died" in err.value.message
            await stream.aclose()
            assert worker.transports == ["lane"]

    asyncio.run(run())
