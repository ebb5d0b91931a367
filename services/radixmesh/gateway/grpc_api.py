"""The public gRPC API (radixmesh.v1.InferenceService) of the gateway and of `radixmesh serve`.

Each call takes the HTTP API's path: its request becomes the HTTP request model (grpc_api_convert),
`start_completion` / `start_chat` validate and admit it through the same dispatcher and backend, and the
run's response objects become the reply. Errors are `RadixMeshError`s mapped to gRPC statuses in the one
place (`map_errors`); a call the client cancels aborts its sequences and frees their KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

import grpc.aio

from radixmesh.common.grpc_errors import map_errors
from radixmesh.gateway import grpc_api_convert as conv
from radixmesh.gateway.openai_api import (
    ChatRun,
    CompletionRun,
    adapter_objects,
    model_object,
    start_chat,
    start_completion,
)
from radixmesh.gateway.state import GatewayState
from radixmesh.gateway.upstreams import not_ready_error
from radixmesh.protocol import common_pb2, inference_pb2_grpc
from radixmesh.protocol import inference_pb2 as pb
from radixmesh.wire.lora_info import load_result_to_proto

logger = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
"""radixmesh.v1.InferenceService"""
ERROR_SOURCE = "gateway"
"""The `service` of the ErrorDetail a failed call carries."""


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    """The API over the gateway's state; `state` is None while the backend starts (calls get UNAVAILABLE)."""

    def __init__(self, state: GatewayState | None = None) -> None:
        self.state = state

    def _ready_state(self) -> GatewayState:
        if self.state is None:
            raise not_ready_error("")
        reason = self.state.backend.not_ready_reason()
        if reason:
            raise not_ready_error(reason)
        return self.state

    @map_errors(ERROR_SOURCE)
    async def Complete(self, request: pb.CompleteRequest, context: grpc.aio.ServicerContext) -> pb.CompleteResponse:
        state = self._ready_state()
        run = await start_completion(state, conv.completion_request(request, stream=False))
        with _client_gone(state, "Complete"):
            response = await _collected(run)
        return conv.completion_reply(response, conv.TokenCursor(run.states))

    @map_errors(ERROR_SOURCE)
    async def StreamComplete(self, request: pb.CompleteRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CompleteResponse]:
        state = self._ready_state()
        run = await start_completion(state, conv.completion_request(request, stream=True))
        tokens = conv.TokenCursor(run.states)
        try:
            with _client_gone(state, "StreamComplete"):
                async for chunk in run.chunks():
                    yield conv.completion_reply(chunk, tokens)
        finally:
            await _shielded(run.generation.aclose())

    @map_errors(ERROR_SOURCE)
    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> pb.ChatResponse:
        state = self._ready_state()
        run = await start_chat(state, conv.chat_request(request, stream=False))
        with _client_gone(state, "Chat"):
            response = await _collected(run)
        return conv.chat_reply(response, conv.TokenCursor(run.states))

    @map_errors(ERROR_SOURCE)
    async def StreamChat(self, request: pb.ChatRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ChatResponse]:
        state = self._ready_state()
        run = await start_chat(state, conv.chat_request(request, stream=True))
        tokens = conv.TokenCursor(run.states)
        try:
            with _client_gone(state, "StreamChat"):
                async for chunk in run.chunks():
                    yield conv.chat_reply(chunk, tokens)
        finally:
            await _shielded(run.generation.aclose())

    @map_errors(ERROR_SOURCE)
    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        state = self._ready_state()
        adapters = await state.backend.list_lora_adapters() if state.backend.card.serves_lora else []
        models = [model_object(state), *adapter_objects(state, adapters)]
        return pb.ListModelsResponse(models=[conv.model_reply(m) for m in models])

    @map_errors(ERROR_SOURCE)
    async def LoadLoraAdapter(self, request: common_pb2.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext) -> common_pb2.LoadLoraAdapterResponse:
        info = await self._ready_state().backend.load_lora_adapter(request.name, request.path, request.worker_id)
        return load_result_to_proto(request.name, info, info.get("worker_ids"))

    @map_errors(ERROR_SOURCE)
    async def UnloadLoraAdapter(self, request: common_pb2.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> common_pb2.UnloadLoraAdapterResponse:
        info = await self._ready_state().backend.unload_lora_adapter(request.name, request.worker_id)
        return common_pb2.UnloadLoraAdapterResponse(worker_ids=info.get("worker_ids", []))


@contextlib.contextmanager
def _client_gone(state: GatewayState, method: str) -> Iterator[None]:
    """A call its client cancelled (it went away before its answer): one info line and the metric, no error."""
    try:
        yield
    except asyncio.CancelledError:
        logger.info("gRPC API %s: the client went away before its answer; its sequences are aborted", method)
        state.metrics.observe_client_gone("grpc")
        raise


async def _collected(run: CompletionRun | ChatRun) -> Any:
    """The run's whole response; its sequences are aborted if the call ends first (cancelled by the client)."""
    try:
        return await run.collect()
    finally:
        await _shielded(run.generation.aclose())


async def _shielded(work: Awaitable[Any]) -> None:
    # Cleanup (aborting sequences, freeing KV) finishes even when the call's task is cancelled again.
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await task
        raise
