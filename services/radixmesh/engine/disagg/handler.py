"""Disaggregation in the scheduler process: routes its messages to the decode-side reservations and
the prefill-side exports, runs their leases, and reports their counters.

The scheduler loop routes each disaggregation message to `handle`. The handler is also a scheduler hook,
called first at every step's start (`tick`), with every abort, and for stats; and the scheduler's outputs go
through `emit_outputs`, so that exported KV leaves ahead of the first token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from radixmesh.engine.disagg.exports import ExportManager
from radixmesh.engine.disagg.fetch import FetchCommitter
from radixmesh.engine.disagg.reservations import ReservationManager
from radixmesh.engine.disagg.transport.choice import ReceiverInfo, encode_receiver_info, local_info
from radixmesh.engine.disagg.transport.registry import create_transport
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.hooks import SchedulerHook
from radixmesh.wire.disagg import (
    CancelReservationMsg,
    CommitFetchMsg,
    ExportCachedReqMsg,
    KVChunkInMsg,
    PrefillReqMsg,
    PrefixLenReqMsg,
    ReleaseTransferMsg,
    ReserveReqMsg,
    ResolveReservationMsg,
    TransferDoneReqMsg,
    TrimReservationMsg,
)
from radixmesh.wire.messages import TokenOut

if TYPE_CHECKING:
    from radixmesh.engine.disagg.transport.base import BaseKVTransport
    from radixmesh.engine.scheduler.core import Scheduler

LANDING_WAIT_S = 0.001
"""An idle step's wait while KV is landing in reservations."""


class DisaggHandler(SchedulerHook):
    """The scheduler's disaggregation side; constructing it plugs it into `scheduler` (its outputs and hooks)."""

    def __init__(self, scheduler: Scheduler, send: Callable[[Any], object],
                 reply: Callable[[str, dict[str, Any]], None]) -> None:
        self.sched = scheduler
        self._emit = scheduler.emit
        self._transports: dict[str, BaseKVTransport] = {}
        self._local: ReceiverInfo | None = None
        self.reservations = ReservationManager(scheduler, self.transport, reply)
        self.reservations.receiver_params = self.receiver_params
        self._reply = reply
        self.exports = ExportManager(scheduler, self.transport, send, local_info=self.local_info)
        self.fetches = FetchCommitter(scheduler, self.reservations)
        """Prefix sharing: fetched prefixes into the radix cache (exports of cached KV are in `exports`)."""
        scheduler.emit = self.emit_outputs
        scheduler.hooks.add(self, first=True)

    def transport(self, transport_id: str) -> BaseKVTransport:
        """The transport `transport_id` over this scheduler's pool, created on first use."""
        transport = self._transports.get(transport_id)
        if transport is None:
            transport = create_transport(transport_id, self.sched.runner.kv_transfer_pool)
            self._transports[transport_id] = transport
        return transport

    def local_info(self) -> ReceiverInfo:
        """This scheduler process as a receiver of KV (computed once; the NIXL agents it holds added each time)."""
        if self._local is None:
            pool = self.sched.runner.kv_transfer_pool
            device = pool.k_buffers[0].device if pool.k_buffers else pool.device
            self._local = local_info(device.type, device.index)
        nixl = self._transports.get("nixl")
        if nixl is None:
            return self._local
        from radixmesh.engine.disagg.transport.nixl import NixlKVTransport

        assert isinstance(nixl, NixlKVTransport), "the nixl id maps to NixlKVTransport"
        return msgspec.structs.replace(self._local, nixl_agents=nixl.receiver_agents())

    def receiver_params(self) -> bytes:
        return encode_receiver_info(self.local_info())

    @property
    def is_busy(self) -> bool:
        """KV is landing (a transport's receives are polled)."""
        return self.reservations.is_busy

    def idle_wait(self, timeout_s: float) -> bool:
        """While KV is landing (a NIXL READ), an idle step waits a short while and counts as work, so that the
        loop steps again soon (its completion is seen at the next step's start) instead of idling."""
        if not self.reservations.is_busy:
            return False
        time.sleep(min(timeout_s, LANDING_WAIT_S))
        return True

    def emit_outputs(self, outputs: list[TokenOut]) -> None:
        self._emit(self.exports.on_outputs(outputs))

    def handle(self, msg: object) -> None:
        if isinstance(msg, ReserveReqMsg):
            self.reservations.reserve(msg)
        elif isinstance(msg, KVChunkInMsg):
            self.reservations.receive(msg)
        elif isinstance(msg, TransferDoneReqMsg):
            self.reservations.transfer_done(msg)
        elif isinstance(msg, ResolveReservationMsg):
            self.reservations.resolve(msg)
        elif isinstance(msg, CancelReservationMsg):
            self.reservations.cancel(msg.reservation_id)
        elif isinstance(msg, PrefillReqMsg):
            self.exports.prefill(msg)
        elif isinstance(msg, ReleaseTransferMsg):
            self.exports.release(msg.transfer_id)
        elif isinstance(msg, ExportCachedReqMsg):
            self.exports.export_cached(msg)
        elif isinstance(msg, PrefixLenReqMsg):
            self._reply(msg.query_id, self.fetches.prefix_len(msg))
        elif isinstance(msg, TrimReservationMsg):
            self.fetches.trim(msg)
        elif isinstance(msg, CommitFetchMsg):
            self.fetches.commit(msg)
        else:
            raise AssertionError(f"not a disaggregation message: {type(msg).__name__}")

    def on_step_start(self) -> None:
        self.tick()

    def remove(self, rid: str) -> list[Req]:
        self.abort(rid)
        return []

    def tick(self) -> None:
        """Leases: free lapsed reservations and held transfers; grant queued reservations that now fit.
        Then, before the step launches its batch, queue the KV export of prompts finishing in the pass on the
        device (`ExportManager.stage_launched`)."""
        for transport in self._transports.values():
            transport.progress()
        self.reservations.tick()
        self.exports.tick()
        self.exports.stage_launched()

    def abort(self, rid: str) -> None:
        self.reservations.abort(rid)
        self.exports.abort(rid)

    def stats(self) -> dict[str, Any]:
        transports: dict[str, Any] = {}
        for transport in self._transports.values():
            transports.update(transport.stats())
        return {**self.reservations.stats(), **self.exports.stats(), **self.fetches.stats(), **transports,
                "kv_transfers_received": dict(self.reservations.by_transport),
                "kv_transfers_sent": dict(self.exports.by_transport),
                "disagg_fallback_reasons": dict(self.reservations.fallback_reasons),
                "peer_fetch_fallback_reasons": dict(self.fetches.fallback_reasons)}
