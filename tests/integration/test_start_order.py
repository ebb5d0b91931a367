"""Start order never matters: every service listens at once, reports not-ready naming what it waits for,
and recovers by itself when the dependency appears, goes away and returns.

The first tests run in-process (fake workers and a fake tokenizer behind real routers, over real gRPC):
the gateway's backend over two router replicas, failover and mid-stream failures. The last one runs
the real processes on the default model, started in the wrong order.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.common.grpc_server import NOT_READY_METADATA_KEY, GrpcServer, GrpcServerConfig
from radixmesh.gateway.cluster_backend import ClusterBackend
from radixmesh.gateway.upstreams import WatchConfig
from radixmesh.protocol import tokenizer_pb2, tokenizer_pb2_grpc
from radixmesh.router.config import HealthConfig, RetryConfig, RouterConfig
from radixmesh.router.discovery.base import BaseDiscovery, OnChange, WorkerEndpoint
from radixmesh.router.discovery.static import StaticDiscovery
from radixmesh.router.server import RouterApp
from radixmesh.wire.sampling import SamplingParams
from tests.fake_worker import FakeWorker
from tests.integration.service_procs import ServiceProc, grpc_serving
from tests.ports import free_port

pytestmark = pytest.mark.integration

FAST_WATCH = WatchConfig(check_interval_s=0.2, retry_min_s=0.05, retry_max_s=0.2, check_timeout_s=1.0)
TOKENIZER_SERVICE = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].full_name


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    """Token id i reads as "<i>"; enough of TokenizerService for the gateway's backend."""

    async def GetTokenizerInfo(self, request: Any, context: Any) -> tokenizer_pb2.GetTokenizerInfoResponse:
        return tokenizer_pb2.GetTokenizerInfoResponse(model_name="fake", vocab_size=1000, fingerprint="fake",
                                                      block_size=16)

    async def Tokenize(self, request: Any, context: Any) -> tokenizer_pb2.TokenizeResponse:
        return tokenizer_pb2.TokenizeResponse(token_ids=[ord(c) % 1000 for c in request.text])

    async def Detokenize(self, requests: Any, context: Any) -> AsyncIterator[tokenizer_pb2.DetokenizeResponse]:
        async for request in requests:
            if request.HasField("tokens"):
                yield tokenizer_pb2.DetokenizeResponse(text="".join(f"<{i}>" for i in request.tokens.token_ids))


async def start_tokenizer(port: int) -> GrpcServer:
    server = GrpcServer(GrpcServerConfig(port=port, metrics_port=-1), "fake-tokenizer", [TOKENIZER_SERVICE])
    tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(FakeTokenizer(), server.server)
    await server.start()
    return server


async def start_router(port: int, workers: list[FakeWorker]) -> RouterApp:
    config = RouterConfig(policy="round-robin", health=HealthConfig(interval_s=0.1, timeout_s=0.5),
                          retry=RetryConfig(max_attempts=2, base_backoff_s=0.01, max_backoff_s=0.02))
    app = RouterApp(GrpcServerConfig(port=port, metrics_port=-1, drain_timeout_s=0.5), config,
                    StaticDiscovery([WorkerEndpoint(w.address, w.address) for w in workers]))
    await app.start()
    return app


async def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def generate_text(backend: ClusterBackend, ids: list[int]) -> str:
    chunks = [c async for c in backend.generate(ids, SamplingParams(max_new_tokens=3))]
    assert chunks[-1].finished
    return "".join(c.text for c in chunks)


@contextlib.asynccontextmanager
async def gateway_first() -> AsyncIterator[tuple[ClusterBackend, list[int], int]]:
    """A gateway backend over two router ports and a tokenizer port where nothing listens yet."""
    router_ports, tokenizer_port = [free_port(), free_port()], free_port()
    backend = await ClusterBackend.start(f"127.0.0.1:{tokenizer_port}",
                                      ",".join(f"127.0.0.1:{p}" for p in router_ports), watch=FAST_WATCH)
    try:
        yield backend, router_ports, tokenizer_port
    finally:
        await backend.close()


def test_gateway_waits_for_two_routers_then_fails_over_when_one_dies() -> None:
    async def run() -> None:
        async with gateway_first() as (backend, router_ports, tokenizer_port):
            unreachable = f"waiting for the tokenizer at 127.0.0.1:{tokenizer_port} (not reachable"
            await wait_until(lambda: unreachable in backend.not_ready_reason(), 10, "the first check of the tokenizer")
            reason = backend.not_ready_reason()
            assert f"waiting for a router at 127.0.0.1:{router_ports[0]} or 127.0.0.1:{router_ports[1]}" in reason
            with pytest.raises(RadixMeshError) as err:
                _ = backend.card
            assert err.value.code is ErrorCode.UNAVAILABLE and "waiting for a router" in err.value.message
            worker = await FakeWorker("w0").start()
            tokenizer = await start_tokenizer(tokenizer_port)
            routers = [await start_router(p, [worker]) for p in router_ports]
            try:
                assert await backend.wait_ready(20), backend.not_ready_reason()
                assert backend.card.name == "fake"
                assert await generate_text(backend, [1, 2, 3]) == "<0><1><2>"
                # Ready means one replica answers; the failover below needs the other seen up as well.
                await wait_until(lambda: all(u.up for u in backend.targets.upstreams), 10, "both replicas up")
                # One replica dies at once (no drain): every request still succeeds, on the other one.
                await routers[0].server.stop()
                await routers[0].close_parts()
                for _ in range(6):
                    assert await generate_text(backend, [4, 5, 6]) == "<0><1><2>"
                assert backend.is_healthy, "one router replica is enough"
                await wait_until(lambda: not backend.targets.upstreams[0].up, 10, "the dead replica marked down")
                # Both gone: not ready, naming them; requests get 503 with the same words.
                await routers[1].server.stop()
                await routers[1].close_parts()
                await wait_until(lambda: not backend.is_healthy, 10, "the gateway to notice")
                assert "waiting for a router at" in backend.not_ready_reason()
                with pytest.raises(RadixMeshError) as err:
                    await generate_text(backend, [7])
                assert err.value.code is ErrorCode.UNAVAILABLE and "waiting for a router" in err.value.message
                # A replica returns on its old port: ready again by itself.
                routers[0] = await start_router(router_ports[0], [worker])
                assert await backend.wait_ready(20), backend.not_ready_reason()
                assert await generate_text(backend, [8, 9]) == "<0><1><2>"
            finally:
                for app in routers:
                    with contextlib.suppress(Exception):
                        await app.stop()
                await tokenizer.server.stop(0)
                await worker.stop()

    asyncio.run(run())


def test_a_stream_cut_after_it_started_moves_to_the_other_router_then_ends_with_a_clear_error() -> None:
    """The router that served a stream stops: the other replica continues it (from the token sent); when that
    one stops too, nothing is left to continue it and the stream ends with an error naming the break."""
    async def run() -> None:
        async with gateway_first() as (backend, router_ports, tokenizer_port):
            worker = await FakeWorker("w0").start()
            worker.mode = "hang-mid"
            tokenizer = await start_tokenizer(tokenizer_port)
            routers = [await start_router(p, [worker]) for p in router_ports]
            try:
                assert await backend.wait_ready(20), backend.not_ready_reason()
                stream = backend.generate([1, 2, 3], SamplingParams(max_new_tokens=3), rid="cut")
                first = await stream.__anext__()
                assert first.text == "<0>"
                owner = next(r for r in routers if r.router.inflight.get("cut") is not None)
                await owner.server.stop()
                second = await stream.__anext__()  # the fake worker resumes after token 0 and hangs again
                assert second.text == "<1>" and worker.requests[-1].resume_output_ids == [0]
                other = next(r for r in routers if r is not owner)
                await other.server.stop()
                with pytest.raises(RadixMeshError) as err:
                    await stream.__anext__()
                assert err.value.code is ErrorCode.UNAVAILABLE
                assert "broke after it started" in err.value.message and "the router at 127.0.0.1:" in err.value.message
                await stream.aclose()
            finally:
                for app in routers:
                    with contextlib.suppress(Exception):
                        await app.server.stop()
                        await app.close_parts()
                await tokenizer.server.stop(0)
                await worker.stop()

    asyncio.run(run())


def test_a_tokenizer_gone_mid_stream_ends_it_with_a_clear_error() -> None:
    """The Detokenize stream failing under a write or a read surfaces as the tokenizer's UNAVAILABLE error
    (an SSE error frame for the client), never as a raw gRPC or asyncio exception that cuts the response."""
    async def run() -> None:
        async with gateway_first() as (backend, router_ports, tokenizer_port):
            worker = await FakeWorker("w0").start()
            worker.num_tokens, worker.delay_s = 50, 0.05
            tokenizer = await start_tokenizer(tokenizer_port)
            routers = [await start_router(p, [worker]) for p in router_ports]
            try:
                assert await backend.wait_ready(20), backend.not_ready_reason()
                stream = backend.generate([1, 2, 3], SamplingParams(max_new_tokens=50))
                assert (await stream.__anext__()).text == "<0>"
                await tokenizer.server.stop(0)
                with pytest.raises(RadixMeshError) as err:
                    async for _ in stream:
                        pass
                assert err.value.code is ErrorCode.UNAVAILABLE, err.value
                assert f"tokenizer at 127.0.0.1:{tokenizer_port}" in err.value.message
            finally:
                for app in routers:
                    with contextlib.suppress(Exception):
                        await app.stop()
                await worker.stop()

    asyncio.run(run())


class LateDiscovery(BaseDiscovery):
    """Reports no worker until the test hands it one."""

    def __init__(self) -> None:
        self.endpoints: asyncio.Queue[list[WorkerEndpoint]] = asyncio.Queue()
        self._stopped = asyncio.Event()

    async def run(self, on_change: OnChange) -> None:
        while not self._stopped.is_set():
            getter = asyncio.ensure_future(self.endpoints.get())
            stopper = asyncio.ensure_future(self._stopped.wait())
            done, pending = await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            if getter in done:
                result = on_change(getter.result())
                if result is not None:
                    await result

    async def stop(self) -> None:
        self._stopped.set()


async def health_of(health: health_pb2_grpc.HealthStub, service: str = "") -> tuple[int, str]:
    call = health.Check(health_pb2.HealthCheckRequest(service=service))
    status = (await call).status
    return status, dict(await call.trailing_metadata()).get(NOT_READY_METADATA_KEY, "")


def test_router_before_its_workers_listens_not_serving_with_the_reason_then_serves() -> None:
    async def run() -> None:
        discovery = LateDiscovery()
        config = RouterConfig(policy="round-robin", health=HealthConfig(interval_s=0.1, timeout_s=0.5))
        app = RouterApp(GrpcServerConfig(port=0, metrics_port=-1, drain_timeout_s=0.5), config, discovery)
        await app.start()
        worker: FakeWorker | None = None
        try:
            async with grpc.aio.insecure_channel(app.server.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                status, reason = await health_of(health)
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING
                assert reason == "waiting for a healthy worker (no worker discovered yet)"
                assert (await health_of(health, "liveness"))[0] == health_pb2.HealthCheckResponse.SERVING
                ghost = free_port()  # discovered, but nothing listens there
                await discovery.endpoints.put([WorkerEndpoint("ghost", f"127.0.0.1:{ghost}")])
                await wait_async(lambda: health_of(health), lambda r: "ghost (UNAVAILABLE" in r[1], "the probe error")
                worker = await FakeWorker("late").start()
                await discovery.endpoints.put([WorkerEndpoint("late", worker.address)])
                await wait_async(lambda: health_of(health),
                                 lambda r: r[0] == health_pb2.HealthCheckResponse.SERVING, "the router to serve")
                await worker.stop()
                worker = None
                status, reason = await wait_async(lambda: health_of(health), lambda r: r[0] != 1, "NOT_SERVING again")
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING and "late (" in reason, reason
        finally:
            await app.stop()
            if worker is not None:
                await worker.stop()

    asyncio.run(run())


async def wait_async(probe: Callable[[], Any], done: Callable[[Any], bool], what: str, timeout_s: float = 20) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = await probe()
        if done(result):
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}: last {result}"
        await asyncio.sleep(0.05)


# ---- real processes, started in the wrong order --------------------------------------------------------
SMALL_ENGINE = ["--device", "cpu", "--max-total-tokens", "4096", "--max-running-requests", "4"]
QUICK_STOP = ["--metrics-port", "-1", "--drain-timeout-s", "1"]


def router_args(worker_port: int) -> list[str]:
    return ["--workers", f"127.0.0.1:{worker_port}", "--health-interval-s", "0.5", *QUICK_STOP]


def spawn(name: str, port: int, args: list[str], http: bool = False) -> ServiceProc:
    """`radixmesh <name>` on a chosen port, not waited on (it may well not become ready yet)."""
    log_path = Path(tempfile.mkdtemp(prefix=f"radixmesh-{name}-")) / f"{name}.log"
    cmd = [sys.executable, "-m", "radixmesh.cli", name, "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={"PYTHONUNBUFFERED": "1",
                                                                                 **_env()})
    return ServiceProc(name, f"http://127.0.0.1:{port}" if http else f"127.0.0.1:{port}", proc, log_path)


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, *procs: ServiceProc) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        for proc in procs:
            assert proc.proc.poll() is None, f"{proc.name} exited with {proc.proc.returncode}:\n{proc.log()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n" + "\n".join(
            f"--- {p.name}\n{p.log()[-2000:]}" for p in procs)
        time.sleep(0.1)


def http_status(url: str) -> tuple[int, str]:
    try:
        response = httpx.get(url, timeout=5)
    except httpx.TransportError as exc:
        return 0, str(exc)
    return response.status_code, response.text


@pytest.fixture
def procs() -> Iterator[dict[str, ServiceProc]]:
    running: dict[str, ServiceProc] = {}
    yield running
    for proc in running.values():
        proc.stop(10)


@pytest.mark.slow
def test_services_started_in_any_order_become_ready_and_recover(procs: dict[str, ServiceProc]) -> None:
    tok_port, router_port, worker_port, gw_port = free_port(), free_port(), free_port(), free_port()
    router_addr = f"127.0.0.1:{router_port}"
    gw = procs["gateway"] = spawn("gateway", gw_port, ["--router", router_addr, "--tokenizer", f"127.0.0.1:{tok_port}",
                                                       "--graceful-shutdown-s", "1"], http=True)
    wait_for(lambda: http_status(gw.address + "/live")[0] == 200, 60, "the gateway to listen", gw)
    status, body = http_status(gw.address + "/health")
    assert status == 503 and f"waiting for the router at {router_addr}" in body, body
    assert f"waiting for the tokenizer at 127.0.0.1:{tok_port}" in body and '"code":"unavailable"' in body
    # The router before its worker: it listens, NOT_SERVING, and says why.
    procs["router"] = spawn("router", router_port, router_args(worker_port))
    procs["tokenizer"] = spawn("tokenizer", tok_port, QUICK_STOP)
    wait_for(lambda: grpc_serving(router_addr, "liveness"), 60, "the router to listen", procs["router"])
    assert not grpc_serving(router_addr)
    wait_for(lambda: "NOT_SERVING: waiting for a healthy worker" in http_status(gw.address + "/health")[1], 60,
             "the gateway to relay the router's reason", gw, procs["router"], procs["tokenizer"])
    procs["worker"] = spawn("worker", worker_port, [*SMALL_ENGINE, *QUICK_STOP])
    wait_for(lambda: http_status(gw.address + "/health")[0] == 200, 300, "the gateway to become ready", *procs.values())
    assert grpc_serving(router_addr)
    complete(gw)
    # The router dies: the gateway stays up and says so within seconds; a new router on the port: ready again.
    procs["router"].proc.send_signal(signal.SIGKILL)
    procs["router"].proc.wait()
    started = time.monotonic()
    wait_for(lambda: f"waiting for the router at {router_addr}" in http_status(gw.address + "/health")[1], 10,
             "the gateway to notice the router is gone", gw)
    assert time.monotonic() - started < 10 and gw.proc.poll() is None
    assert http_status(gw.address + "/live")[0] == 200
    procs["router"] = spawn("router", router_port, router_args(worker_port))
    wait_for(lambda: http_status(gw.address + "/health")[0] == 200, 60, "the gateway to recover", gw, procs["router"])
    complete(gw)
    assert "Traceback" not in gw.log(), gw.log()


def complete(gw: ServiceProc) -> None:
    response = httpx.post(gw.address + "/v1/completions", timeout=120,
                          json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
