"""`radixmesh gateway --embedded-router FLAGS`: the router runs inside the gateway's process.

The gateway then sends Generate straight to the chosen worker: one gRPC hop each way less than through a
router service (each hop of a streamed request costs ~1.4 ms; see docs/benchmarks, sixth session). The
router's own parts are the same (discovery, health checks, policies with the Redis KV-cache index, retries
before the first token): a `RouterApp` without a server, called through the stub-shaped adapter below, so
`ClusterBackend` treats it as one more router replica. What a separate router gives up here: several gateways
each keep their own health checks and recent decisions (the Redis index is still shared).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Iterator
from typing import Any

import grpc.aio
from grpc_health.v1 import health_pb2
from prometheus_client import REGISTRY
from prometheus_client.metrics_core import Metric

from radixmesh.common.grpc_server import NOT_READY_METADATA_KEY
from radixmesh.engine.tokenize_pool import DEFAULT_TOKENIZER_WORKERS
from radixmesh.gateway.cluster_backend import ClusterBackend
from radixmesh.gateway.upstreams import Upstream
from radixmesh.protocol import worker_pb2
from radixmesh.router.commands import embedded_router_flags
from radixmesh.router.server import RouterApp
from radixmesh.router.service import RouterServicer

ADDRESS = "in-process"


class InProcessCall:
    """The stream of one routed Generate, shaped as the part of a grpc.aio call the gateway uses."""

    def __init__(self, stream: AsyncGenerator[worker_pb2.GenerateResponse, None]) -> None:
        self._stream = stream
        self._done = False
        self._closing: asyncio.Task[None] | None = None

    async def read(self) -> Any:
        """The next message, or grpc.aio.EOF at the end; the router's RadixMeshError as it is."""
        if self._done:
            return grpc.aio.EOF
        try:
            return await anext(self._stream)
        except StopAsyncIteration:
            self._done = True
            return grpc.aio.EOF
        except BaseException:
            self._done = True
            raise

    def done(self) -> bool:
        return self._done

    def cancel(self) -> bool:
        """Stop the stream (the router cancels the worker's call, which aborts the request); idempotent."""
        if self._done:
            return False
        self._done = True
        self._closing = asyncio.get_running_loop().create_task(self._close())
        return True

    async def _close(self) -> None:
        with contextlib.suppress(RuntimeError):  # a read still running in another task ends the stream itself
            await self._stream.aclose()


def _unwrapped(method: Callable[..., Any]) -> Callable[..., Any]:
    """A servicer method without its gRPC error mapping (errors stay RadixMeshError in process)."""
    return getattr(method, "__wrapped__", method)


class InProcessRouterStub:
    """RouterService's methods called in this process, with the stub's call signatures."""

    def __init__(self, servicer: RouterServicer) -> None:
        self._servicer = servicer
        self._generate = _unwrapped(RouterServicer.Generate)

    def Generate(self, request: worker_pb2.GenerateRequest) -> InProcessCall:
        return InProcessCall(self._generate(self._servicer, request, None))

    def _unary(self, method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        call = _unwrapped(method)

        async def invoke(request: Any, timeout: float | None = None, **_: Any) -> Any:
            coro = call(self._servicer, request, None)
            return await (asyncio.wait_for(coro, timeout) if timeout is not None else coro)
        return invoke

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        if name in ("Abort", "GetLoad", "FlushCache", "GetModelInfo", "ListWorkers", "LoadLoraAdapter",
                    "UnloadLoraAdapter", "ListLoraAdapters"):
            return self._unary(getattr(RouterServicer, name))
        raise AttributeError(name)


class _HealthCall:
    """An awaitable health answer with the trailing metadata `check_peer_health` reads."""

    def __init__(self, reason: str) -> None:
        self._reason = reason

    def __await__(self) -> Generator[Any, None, health_pb2.HealthCheckResponse]:
        status = health_pb2.HealthCheckResponse.NOT_SERVING if self._reason else health_pb2.HealthCheckResponse.SERVING
        yield from asyncio.sleep(0).__await__()
        return health_pb2.HealthCheckResponse(status=status)

    async def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((NOT_READY_METADATA_KEY, self._reason),) if self._reason else ()


class _InProcessHealth:
    def __init__(self, app: RouterApp) -> None:
        self._app = app

    def Check(self, request: health_pb2.HealthCheckRequest, timeout: float | None = None) -> _HealthCall:
        return _HealthCall(self._app.not_ready_reason)


class RouterMetrics:
    """The router's series of this process's default registry (where radixmesh.router.metrics lives)."""

    def collect(self) -> Iterator[Metric]:
        return (family for family in REGISTRY.collect() if family.name.startswith("radixmesh_router_"))


class EmbeddedRouter(Upstream):
    """The gateway's one router "replica": a RouterApp in this process, up while it has a healthy worker."""

    def __init__(self, app: RouterApp) -> None:  # no channel: nothing to dial
        self.kind, self.address = "router", ADDRESS
        self.app = app
        self.stub: Any = InProcessRouterStub(app.servicer)
        self.health: Any = _InProcessHealth(app)
        self.up = False
        self.detail = "not checked yet"
        self.wake = asyncio.Event()
        self.metric_views = [(RouterMetrics(), "router")]
        """The gateway's /metrics shows the router's series, labelled service="router"."""

    @property
    def description(self) -> str:
        return "the router in this process"

    async def close(self) -> None:
        await self.app.close_parts()


async def start_embedded(tokenizer_address: str, router_flags: str, served_model_name: str | None = None,
                         detokenize: str = "local", tokenize: str = "local",
                         tokenizer_workers: int = DEFAULT_TOKENIZER_WORKERS) -> ClusterBackend:
    """A gateway backend that routes in this process with `radixmesh router`'s flags (`router_flags`)."""
    app = RouterApp(None, *embedded_router_flags(router_flags))
    await app.start()
    return await ClusterBackend.start(tokenizer_address, ADDRESS, "router", served_model_name,
                                   detokenize=detokenize, target=EmbeddedRouter(app), tokenize=tokenize,
                                   tokenizer_workers=tokenizer_workers)
