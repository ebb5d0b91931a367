"""The gateway's public gRPC port: InferenceService, grpc.health.v1 and server reflection, with the
gateway's API keys and TLS.

    server = PublicGrpcServer(config, api_keys)      # before the backend starts: calls get UNAVAILABLE
    port = server.bind()                             # a busy port fails at once
    await server.start()
    server.attach(state)                             # once the backend is up
    ...
    await server.stop(grace_s)                       # NOT_SERVING, open calls finish within grace_s

Health: "" and radixmesh.v1.InferenceService are SERVING while the backend is ready (NOT_SERVING with the
reason in the `radixmesh-not-ready` trailer otherwise); `liveness` is SERVING while the process serves.
Health needs no key (probes); everything else, reflection included, needs `authorization: Bearer <key>`
when the gateway has keys, as the HTTP API's routes do.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from radixmesh.common import aio, tracing
from radixmesh.common.errors import RadixMeshError, invalid_argument
from radixmesh.common.grpc_errors import abort_with
from radixmesh.common.grpc_server import LIVENESS_SERVICE, MAX_MESSAGE_BYTES, NOT_READY_METADATA_KEY
from radixmesh.gateway.auth import ApiKeys
from radixmesh.gateway.config import GatewayConfig
from radixmesh.gateway.grpc_api import ERROR_SOURCE, SERVICE_NAME, InferenceServicer
from radixmesh.gateway.state import GatewayState
from radixmesh.protocol import inference_pb2_grpc

logger = logging.getLogger(__name__)
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
"""Methods served without an API key (probes)."""
HEALTH_POLL_S = 1.0
"""How often the health status follows the backend's readiness (Check also looks at once)."""
KEY_HINT = "gRPC metadata 'authorization: Bearer <key>'"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without an accepted key with UNAUTHENTICATED (the error mapped in the one place)."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        method = details.method
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(details)
        metadata = details.invocation_metadata or ()
        authorization = next((value for key, value in metadata if key == "authorization"), None)
        error = self.keys.check(authorization, KEY_HINT)
        handler = await continuation(details)
        if error is None or handler is None:
            return handler
        return _refusing(handler, error)


def _refusing(handler: grpc.RpcMethodHandler, error: RadixMeshError) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with `error`, reading no request."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort_with(context, error, ERROR_SOURCE)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await abort_with(context, error, ERROR_SOURCE)
        yield  # pragma: no cover - abort raises

    codecs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, **codecs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **codecs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, **codecs)
    return grpc.unary_unary_rpc_method_handler(unary, **codecs)


class _BackendHealth(HealthServicer):
    """grpc.health.v1 that follows the backend's readiness, with the reason of NOT_SERVING in a trailer."""

    def __init__(self, servicer: InferenceServicer) -> None:
        super().__init__()
        self.servicer = servicer
        self.stopping = False

    def not_ready_reason(self) -> str:
        if self.stopping:
            return "shutting down"
        state = self.servicer.state
        return "the gateway is starting" if state is None else state.backend.not_ready_reason()

    async def sync(self) -> str:
        reason = self.not_ready_reason()
        status = health_pb2.HealthCheckResponse.NOT_SERVING if reason else health_pb2.HealthCheckResponse.SERVING
        for service in ("", SERVICE_NAME):
            await self.set(service, status)
        return reason

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> Any:
        reason = await self.sync()
        reply = await super().Check(request, context)
        if reply is not None and reason and request.service != LIVENESS_SERVICE:
            context.set_trailing_metadata(((NOT_READY_METADATA_KEY, reason.encode("ascii", "replace").decode()),))
        return reply


class PublicGrpcServer:
    """The public gRPC port of a gateway (see the module docstring)."""

    def __init__(self, config: GatewayConfig, api_keys: ApiKeys | None) -> None:
        assert config.grpc_port is not None, "the gRPC API needs a port"
        self.config = config
        interceptors: list[Any] = [*tracing.server_interceptors()]
        if api_keys is not None:
            interceptors.append(ApiKeyInterceptor(api_keys))
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)]
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        self.servicer = InferenceServicer()
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(self.servicer, self.server)
        self.health = _BackendHealth(self.servicer)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server)
        self.port = 0
        self._poll: asyncio.Task[None] | None = None

    @property
    def serves_tls(self) -> bool:
        return self.config.serves_tls

    def bind(self) -> int:
        """Listen on the configured port (TLS when the gateway has a certificate); returns the port."""
        address = f"{self.config.host}:{self.config.grpc_port}"
        try:
            if self.config.tls is not None and self.config.tls.serves_tls:
                credentials = self.config.tls.server_credentials(require_client_cert=False)
                self.port = self.server.add_secure_port(address, credentials)
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise invalid_argument(f"cannot listen on {address} for the gRPC API: {exc}", "grpc_port") from None
        return self.port

    async def start(self) -> None:
        await self.server.start()
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self.health.sync()
        self._poll = asyncio.get_running_loop().create_task(self._follow_readiness())

    def attach(self, state: GatewayState) -> None:
        """Serve `state`'s backend from now on."""
        self.servicer.state = state

    async def _follow_readiness(self) -> None:
        while True:
            await self.health.sync()
            await asyncio.sleep(HEALTH_POLL_S)

    async def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING, refuse new calls and let open ones run for `grace_s` (then they are cancelled,
        which aborts their sequences)."""
        await aio.cancel_and_wait(self._poll)
        self.health.stopping = True
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
