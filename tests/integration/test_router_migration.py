"""Migration and drain through a real router over gRPC, in front of model-free fake workers (fast).

A fake worker streams token ids 0, 1, ... and, asked to resume, continues after the ids it was given, so a
client that gets 0..N-1 exactly once got one uninterrupted stream.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import grpc.aio
import pytest

from radixmesh.common.errors import ErrorCode
from radixmesh.common.grpc_errors import from_rpc_error
from radixmesh.protocol import common_pb2, worker_pb2
from radixmesh.router import metrics
from radixmesh.router.config import HealthConfig, MigrationConfig
from tests.integration.test_router_service import cluster, request

pytestmark = pytest.mark.integration
N = 6


def migrations(reason: str) -> float:
    return metrics.MIGRATIONS.labels(reason)._value.get()


async def tokens_of(stub, req: worker_pb2.GenerateRequest) -> list[worker_pb2.GenerateResponse]:
    return [msg async for msg in stub.Generate(req, timeout=20)]


def flat(msgs: list[worker_pb2.GenerateResponse]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def test_a_stream_moves_on_every_break_and_the_client_gets_each_token_once() -> None:
    """Both workers die after two tokens: the stream goes A -> B -> A (back once A is healthy again)."""
    async def run() -> None:
        async with cluster(policy="round-robin") as c:
            for w in c.workers:
                w.mode, w.fail_after, w.num_tokens = "fail-mid", 2, N
            before = migrations("worker-lost")
            req = request(list(range(40)), rid="mig")
            req.sampling_params.max_new_tokens = N
            req.sampling_params.logprob_start_len = 3
            msgs = await tokens_of(c.stubs[0], req)
            assert flat(msgs) == list(range(N))
            assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert msgs[-1].completion_tokens == N and msgs[-1].prompt_tokens == 40
            assert {m.request_id for m in msgs} == {"mig"}
            assert migrations("worker-lost") - before == 2
            legs = sorted((r for w in c.workers for r in w.requests), key=lambda r: len(r.resume_output_ids))
            assert [r.request_id for r in legs] == ["mig", "mig~1", "mig~2"]
            assert [list(r.resume_output_ids) for r in legs] == [[], [0, 1], [0, 1, 2, 3]]
            assert legs[0].sampling_params.logprob_start_len == 3
            assert not legs[1].sampling_params.HasField("logprob_start_len"), "prompt log-probs went with leg 1"
            assert [m.routing.attempt for m in msgs if m.HasField("routing")] == [1, 2, 3]

    asyncio.run(run())


def test_migration_off_and_the_limit_end_the_stream_with_the_error() -> None:
    async def run() -> None:
        for migration, expected_legs in ((MigrationConfig(enabled=False), 1), (MigrationConfig(max_per_request=1), 2)):
            async with cluster(policy="round-robin", migration=migration) as c:
                for w in c.workers:
                    w.mode, w.fail_after, w.num_tokens = "fail-mid", 2, N
                got: list[int] = []
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for msg in c.stubs[0].Generate(request(list(range(40)), rid="lim"), timeout=20):
                        got.extend(msg.token_ids)
                assert got == list(range(2 * expected_legs))
                assert "mid-stream" in from_rpc_error(info.value).message
                assert sum(len(w.requests) for w in c.workers) == expected_legs

    asyncio.run(run())


def test_a_draining_worker_hands_its_stream_over_without_a_breaker_failure() -> None:
    async def run() -> None:
        async with cluster(policy="round-robin") as c:
            draining, other = c.workers
            draining.mode, draining.fail_after = "drain-mid", 1
            for w in c.workers:
                w.num_tokens = N
            before = migrations("drain")
            results = [await tokens_of(c.stubs[0], request(list(range(40)), rid=f"d{i}")) for i in range(2)]
            assert all(flat(msgs) == list(range(N)) for msgs in results)
            assert migrations("drain") - before == 1
            handle = c.apps[0].registry.get(draining.address)
            assert handle is not None and handle.breaker._failures == 0  # a drain is no failure
            assert any(list(r.resume_output_ids) == [0] for r in other.requests)

    asyncio.run(run())


def test_the_health_watch_takes_a_worker_out_as_soon_as_it_stops_serving() -> None:
    """Probes every 60 s: only the watch can notice within the test."""
    async def run() -> None:
        async with cluster(policy="round-robin", health=HealthConfig(interval_s=60.0, timeout_s=0.5)) as c:
            target = c.workers[0]
            handle = c.apps[0].registry.get(target.address)
            assert handle is not None and handle.health.healthy
            start = time.monotonic()
            await target.server.set_serving(False)
            while handle.health.healthy:
                assert time.monotonic() - start < 5, "the router did not hear the worker stop serving"
                await asyncio.sleep(0.02)
            assert [w.worker_id for w in c.apps[0].registry.available()] == [c.workers[1].address]

    asyncio.run(run())


def test_a_draining_router_refuses_new_calls_and_cuts_open_streams_with_draining() -> None:
    async def run() -> None:
        async with cluster(policy="round-robin") as c:
            for w in c.workers:
                w.num_tokens, w.delay_s = 400, 0.02
            call = c.stubs[0].Generate(request(list(range(40)), rid="long"), timeout=30)
            first = await call.read()
            drain = asyncio.create_task(c.apps[0].servicer.drain_streams(0.3))
            await asyncio.sleep(0.05)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await tokens_of(c.stubs[0], request(list(range(40)), rid="late"))
            assert from_rpc_error(refused.value).code is ErrorCode.DRAINING
            got = list(first.token_ids)
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                while (msg := await call.read()) is not grpc.aio.EOF:
                    got.extend(msg.token_ids)
            assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
            assert from_rpc_error(cut.value).code is ErrorCode.DRAINING
            assert got == list(range(len(got))) and 0 < len(got) < 400
            assert await drain == 1
            assert any("long" in w.aborted for w in c.workers)

    asyncio.run(run())


@pytest.mark.parametrize("fault", ["drain", "stop"])
def test_the_gateway_hands_a_stream_to_another_router_replica(fault: str) -> None:
    """A router replica that drains (cuts its streams DRAINING) or stops mid-stream: the gateway continues the
    stream through the other one, resuming from the tokens it had."""
    from radixmesh.gateway.cluster_backend import ClusterBackend
    from radixmesh.wire.sampling import SamplingParams
    from tests.integration.test_start_order import FAST_WATCH, start_tokenizer, wait_until

    async def run() -> None:
        async with cluster(policy="round-robin", num_routers=2) as c:
            for w in c.workers:
                w.num_tokens, w.delay_s = 30, 0.03
            tokenizer = await start_tokenizer(0)
            addresses = ",".join(app.server.address for app in c.apps if app.server is not None)
            backend = await ClusterBackend.start(tokenizer.address, addresses, watch=FAST_WATCH, transport="grpc")
            try:
                assert await backend.wait_ready(20), backend.not_ready_reason()
                await wait_until(lambda: all(u.up for u in backend.targets.upstreams), 10, "both routers up")
                ids: list[int] = []
                stream = backend.generate(list(range(40)), SamplingParams(max_new_tokens=30), rid="fo")
                async for chunk in stream:
                    ids += chunk.token_ids
                    if len(ids) == 3:
                        target = backend.generation.inflight["fo"]
                        app = next(a for a in c.apps if a.server is not None and a.server.address == target.address)
                        if fault == "drain":
                            asyncio.get_running_loop().create_task(app.servicer.drain_streams(0.05))
                        else:
                            assert app.server is not None
                            await app.server.stop(0)
                assert ids == list(range(30))
                legs = [r for w in c.workers for r in w.requests]
                assert any(r.request_id.startswith("fo~g") and list(r.resume_output_ids) == ids[: len(
                    r.resume_output_ids)] and r.resume_output_ids for r in legs)
            finally:
                await backend.close()
                await tokenizer.stop()

    asyncio.run(run())
