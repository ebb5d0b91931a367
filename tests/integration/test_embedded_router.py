"""`radixmesh gateway --embedded-router`: the gateway routes in its own process and calls workers itself.

In process, over real gRPC to fake workers and a fake tokenizer: readiness names what the embedded router
waits for, requests spread by the policy, a worker that refuses before streaming is retried on another, an
abort and a client leaving mid-stream reach the worker, and the control calls answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io

import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.gateway.embedded_router import ADDRESS, EmbeddedRouter, start_embedded
from radixmesh.router.commands import embedded_router_flags
from radixmesh.router.server import make_reader
from radixmesh.wire.sampling import SamplingParams
from tests.fake_worker import FakeWorker
from tests.integration.test_start_order import generate_text, start_tokenizer, wait_until
from tests.ports import free_port

pytestmark = pytest.mark.integration

FAST = "--policy round-robin --health-interval-s 0.1 --max-attempts 2 --wait-for-worker-s 0"


def test_routes_retries_aborts_and_answers_control_calls() -> None:
    async def run() -> None:
        workers = [await FakeWorker("w0").start(), await FakeWorker("w1").start()]
        tokenizer_port = free_port()
        tokenizer = await start_tokenizer(tokenizer_port)
        backend = await start_embedded(f"127.0.0.1:{tokenizer_port}",
                                       f"--workers {workers[0].address},{workers[1].address} {FAST}")
        try:
            assert await backend.wait_ready(20), backend.not_ready_reason()
            assert isinstance(backend.targets.upstreams[0], EmbeddedRouter)
            assert backend.card.name == "fake" and backend.card.extra["router"] == ADDRESS
            assert backend.readiness_details()["dependencies"]["router"]["address"] == ADDRESS
            for _ in range(4):
                assert await generate_text(backend, [1, 2, 3]) == "<0><1><2>"
            assert [len(w.requests) for w in workers] == [2, 2], "round-robin over both workers"
            # a worker that refuses before its first message: the request is retried on the other one
            workers[0].mode = "refuse"
            for _ in range(3):
                assert await generate_text(backend, [4, 5]) == "<0><1><2>"
            workers[0].mode = "ok"
            # abort by request id: the router in this process forwards it to the worker running it
            workers[1].mode = workers[0].mode = "hang-mid"
            stream = backend.generate([6, 7], SamplingParams(max_new_tokens=3), rid="held")
            first = await anext(stream)
            assert first.token_ids == [0]
            await backend.abort("held")
            assert any("held" in w.aborted for w in workers)
            await stream.aclose()
            # a client that leaves mid-stream: the worker's call is cancelled
            stream = backend.generate([8, 9], SamplingParams(max_new_tokens=3), rid="left")
            await anext(stream)
            await stream.aclose()
            await wait_until(lambda: all("left" not in w.running for w in workers), 5, "the worker's call to end")
            # control calls through the router in this process (w0, marked down by its refusal, is probed back)
            registry = backend.targets.upstreams[0].app.registry
            await wait_until(lambda: all(w.health.healthy for w in registry.all()), 5, "both workers healthy")
            assert await backend.flush_cache()
            load = await backend.server_info()
            assert load["max_total_num_tokens"] == 20_000, load  # both workers' pools, summed by the router
        finally:
            await backend.close()
            await tokenizer.server.stop(0)
            for w in workers:
                await w.stop()

    asyncio.run(run())


def test_not_ready_until_a_worker_answers() -> None:
    async def run() -> None:
        tokenizer_port, worker_port = free_port(), free_port()
        tokenizer = await start_tokenizer(tokenizer_port)
        backend = await start_embedded(f"127.0.0.1:{tokenizer_port}", f"--workers 127.0.0.1:{worker_port} {FAST}")
        try:
            await wait_until(lambda: f"127.0.0.1:{worker_port}" in backend.not_ready_reason(), 10,
                             "the router's reason, naming its worker")
            reason = backend.not_ready_reason()
            assert "the router in this process" in reason and f"127.0.0.1:{worker_port}" in reason, reason
            with pytest.raises(RadixMeshError) as err:
                _ = backend.card
            assert err.value.code is ErrorCode.UNAVAILABLE
        finally:
            await backend.close()
            await tokenizer.server.stop(0)

    asyncio.run(run())


def test_flags_are_the_routers() -> None:
    config, _ = embedded_router_flags("--workers 127.0.0.1:1,127.0.0.1:2 --policy power-of-two --max-attempts 5")
    assert config.policy == "power-of-two" and config.retry.max_attempts == 5
    assert config.index_lookup == "inline", "index lookups block the loop for one round trip by default"
    config, _ = embedded_router_flags("--workers 127.0.0.1:1 --index-lookup async --redis-url redis://127.0.0.1:1/0")
    readers = [make_reader(config), make_reader(dataclasses.replace(config, index_lookup="inline"))]
    assert [reader.inline is not None for reader in readers if reader is not None] == [False, True]
    with pytest.raises(RadixMeshError, match="index_lookup must be one of inline, async"):
        dataclasses.replace(config, index_lookup="threaded")
    with contextlib.redirect_stderr(io.StringIO()) as usage, pytest.raises(SystemExit):
        embedded_router_flags("--policy nope")
    assert "radixmesh gateway --embedded-router" in usage.getvalue()
    with pytest.raises(RadixMeshError, match="redis discovery needs --redis-url"):
        embedded_router_flags("--policy round-robin")
