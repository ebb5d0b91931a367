"""What every route handler needs: the backend, the dispatcher, metrics, config."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request

from radixmesh.common import aio
from radixmesh.common.errors import ErrorCode, RadixMeshError, not_found
from radixmesh.gateway.backend import GatewayBackend
from radixmesh.gateway.config import GatewayConfig
from radixmesh.gateway.dispatch import Dispatcher
from radixmesh.gateway.metrics import GatewayMetrics
from radixmesh.wire.lora import split_model_name

T = TypeVar("T")
DEFAULT_MODEL = "default"
"""A `model` every gateway accepts as its one served model (SGLang serves under this name by default)."""


@dataclass(frozen=True)
class GatewayState:
    backend: GatewayBackend
    config: GatewayConfig
    metrics: GatewayMetrics
    dispatcher: Dispatcher

    def resolve_model(self, requested: str | None) -> str:
        """The served name for a request's `model` (absent, or "default" as SGLang's examples send it, means
        the served model); 404 otherwise."""
        name, adapter = self.resolve_model_adapter(requested)
        if adapter is not None:
            raise not_found(f"The model '{requested}' does not exist; this server serves '{name}'", "model")
        return name

    def resolve_model_adapter(self, requested: str | None) -> tuple[str, str | None]:
        """(served name, LoRA adapter) of a request's `model`: the base model's name (or "default"), "base:adapter"
        or "adapter" (OpenAI's way to name a fine-tune) where adapters are served; 404 for anything else."""
        card = self.backend.card
        if requested is None or requested in ("", DEFAULT_MODEL) or card.accepts(requested):
            return card.name, None
        if card.serves_lora:
            _, adapter = split_model_name(requested, (card.name, *card.aliases))
            if adapter is not None and ":" not in adapter:
                return card.name, adapter
        raise not_found(f"The model '{requested}' does not exist; this server serves '{card.name}'", "model")


def get_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (so its sequences are aborted) if the client disconnects first.

    The body must have been read already: from then on the only message ASGI delivers is the
    disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise RadixMeshError(ErrorCode.ABORTED, "the client disconnected before the response was ready")
    finally:
        await aio.cancel_and_wait(task, watcher)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
