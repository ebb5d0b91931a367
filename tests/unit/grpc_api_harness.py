"""A gateway over the scripted FakeBackend serving both APIs in this event loop: HTTP through httpx's ASGI
transport, gRPC on a real loopback port. For tests that compare the two or check what they share."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
import httpx

from radixmesh.common.grpc_errors import ERROR_METADATA_KEY
from radixmesh.gateway.app import create_app
from radixmesh.gateway.auth import ApiKeys, api_keys_of
from radixmesh.gateway.config import GatewayConfig
from radixmesh.gateway.grpc_api_server import PublicGrpcServer
from radixmesh.protocol import common_pb2, inference_pb2_grpc
from tests.unit.test_gateway_api import FakeBackend


@dataclass
class Gateway:
    backend: FakeBackend
    http: httpx.AsyncClient
    channel: grpc.aio.Channel
    stub: inference_pb2_grpc.InferenceServiceStub
    server: PublicGrpcServer
    app: Any

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"


@contextlib.asynccontextmanager
async def gateway(backend: FakeBackend | None = None, config: GatewayConfig | None = None,
                  attach: bool = True, channel: grpc.aio.Channel | None = None,
                  keys: ApiKeys | None = None) -> AsyncIterator[Gateway]:
    """Both APIs over `backend`; `attach=False` leaves the gRPC API in its starting state."""
    backend = backend or FakeBackend()
    config = config or GatewayConfig(grpc_port=0)
    keys = keys or api_keys_of(config)
    app = create_app(backend, config, keys)
    server = PublicGrpcServer(config, keys)
    server.bind()
    await server.start()
    if attach:
        server.attach(app.state.gateway)
    channel = channel or grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=30)
    try:
        yield Gateway(backend, http, channel, inference_pb2_grpc.InferenceServiceStub(channel), server, app)
    finally:
        await http.aclose()
        await channel.close()
        await server.stop(0)


def sse_events(body: str) -> list[dict[str, Any]]:
    """The JSON objects of an SSE body (the [DONE] frame dropped)."""
    events = []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


def error_detail(exc: grpc.aio.AioRpcError) -> common_pb2.ErrorDetail:
    for key, value in exc.trailing_metadata() or ():
        if key == ERROR_METADATA_KEY:
            return common_pb2.ErrorDetail.FromString(value)
    raise AssertionError(f"no {ERROR_METADATA_KEY} in the trailers of {exc.code()}: {exc.details()}")
