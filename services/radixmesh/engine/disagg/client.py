"""Async front end of disaggregation: the typed messages a worker sends its scheduler process to
reserve KV, land transferred chunks and commit (decode side), or compute and export a prompt's KV
(prefill side). A thin layer over one `EngineClient`; the state machine itself runs in the
scheduler process (`radixmesh.engine.disagg`).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.client import EngineClient
from radixmesh.wire.disagg import (
    CancelReservationMsg,
    KVChunk,
    KVChunkInMsg,
    KVExportMsg,
    PrefillReqMsg,
    ReleaseTransferMsg,
    ReserveReqMsg,
    ResolveReservationMsg,
    TransferDoneReqMsg,
)
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.sampling import SamplingParams

REPLY_MARGIN_S = 30.0
"""Extra time, beyond a reservation's lease, to wait for the scheduler's answer."""


@dataclass(frozen=True)
class Grant:
    """A granted reservation: slots for prompt positions [prefix_len, prefix_len + num_reserved_tokens)."""

    reservation_id: str
    prefix_len: int
    """Prompt tokens this worker holds already (from its radix cache); the prefill worker sends the rest."""
    num_reserved_tokens: int
    lease_s: float
    """Left of the lease when granted: the slots are freed if the reservation is not resolved by then."""
    transport_params: bytes = b""
    """This side described for the exporting side's transport (`PrefillStart.transport_params`)."""


class DisaggClient:
    """Disaggregation messages to one scheduler process.

    Decode side: `reserve` -> `land` per chunk -> `transfer_done` -> `resolve` (commit, or compute
    the prompt here), or `cancel`. Prefill side: `prefill` streams the KV chunks and then the
    first token; `release` unlocks the exported KV once the decode side holds it.
    """

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    # ---- decode side ------------------------------------------------------------------------------
    async def reserve(self, rid: str, input_ids: list[int], params: SamplingParams, lease_s: float) -> Grant:
        """KV slots for the part of the prompt not cached here; waits while KV is short, up to the lease.

        Raises RESOURCE_EXHAUSTED when refused (no slots within the lease, or a prompt that cannot fit).
        """
        reservation_id = uuid.uuid4().hex
        msg = ReserveReqMsg(uuid.uuid4().hex, reservation_id, rid, list(input_ids), params, lease_s)
        try:
            reply = await self.engine.query(msg, timeout_s=lease_s + REPLY_MARGIN_S)
        except BaseException:
            await self.cancel(reservation_id)  # it may still be pending, or granted meanwhile
            raise
        if not reply.get("ok"):
            raise RadixMeshError(ErrorCode.RESOURCE_EXHAUSTED, f"KV reservation refused: {reply.get('error')}")
        return Grant(reservation_id, int(reply["prefix_len"]), int(reply["num_reserved_tokens"]),
                     float(reply["lease_s"]), bytes(reply.get("transport_params") or b""))

    async def land(self, reservation_id: str, chunk: KVChunk) -> None:
        """Write one received chunk into the reservation's slots (errors surface in `transfer_done`)."""
        await self.engine.send(KVChunkInMsg(reservation_id, chunk))

    async def transfer_done(self, reservation_id: str) -> int:
        """Wait until every landed chunk is in the pool; returns the bytes received.

        Raises UNAVAILABLE when a layer is missing, a chunk was rejected, or the reservation is gone.
        """
        reply = await self.engine.query(TransferDoneReqMsg(uuid.uuid4().hex, reservation_id))
        if not reply.get("ok"):
            raise RadixMeshError(ErrorCode.UNAVAILABLE, f"KV transfer incomplete: {reply.get('error')}")
        return int(reply.get("num_bytes", 0))

    def resolve(self, msg: ResolveReservationMsg) -> AsyncGenerator[TokenOut, None]:
        """Commit with the first token (or compute the prompt here) and stream the sequence's tokens.

        The first token comes back as the first message; leaving early aborts the sequence.
        """
        return self._tokens(msg)

    async def cancel(self, reservation_id: str) -> None:
        """Give the reservation up: its slots are freed (a no-op when it is gone already)."""
        if self.engine.is_alive:
            await self.engine.send(CancelReservationMsg(reservation_id))

    # ---- prefill side -----------------------------------------------------------------------------
    def prefill(self, msg: PrefillReqMsg) -> AsyncGenerator[TokenOut | KVExportMsg, None]:
        """Compute the prompt and stream its exported KV chunks, then one TokenOut with the first token.

        Leaving early aborts the prefill and releases whatever was exported.
        """
        return self.engine.stream(msg)

    async def release(self, transfer_id: str) -> None:
        """The decode side holds the KV (or gave up): unlock the exported copy here."""
        if self.engine.is_alive:
            await self.engine.send(ReleaseTransferMsg(transfer_id))

    async def _tokens(self, msg: ResolveReservationMsg) -> AsyncGenerator[TokenOut, None]:
        async with contextlib.aclosing(self.engine.stream(msg)) as outs:
            async for out in outs:
                assert isinstance(out, TokenOut), "a resolved reservation streams tokens only"
                yield out
