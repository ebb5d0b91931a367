"""Decode side: KV reservations under leases, filled by a transport, then committed or given up.

A reservation is a request row holding the decode worker's own cached prefix of the prompt
(locked in its radix tree) plus freshly allocated slots for the rest of the prompt (the
"suffix", at least one token). States:

    pending --(KV free)--> granted --(every layer received)--> complete --(resolve)--> running request
       |                      |                                   |
       +--(lease)--> refused  +--(lease lapsed / cancel / abort / resolve without KV)--> slots freed

Resolving without a complete transfer (or without a first token) computes the prompt here
instead: the request is queued like a plain Generate, so it is never lost.

A transport may land a chunk after `receive` returned (nixl's READ): its `PendingReceive`s are polled
by `tick`, `transfer_done` is answered once they landed (`receives`), and a reservation given up
meanwhile keeps its slots until they are stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.device_io import HostCopy
from radixmesh.engine.disagg.receives import Draining, InFlight, poll_receives
from radixmesh.engine.request import Req
from radixmesh.wire.disagg import KVChunkInMsg, ReserveReqMsg, ResolveReservationMsg, TransferDoneReqMsg

if TYPE_CHECKING:
    from radixmesh.engine.disagg.transport.base import BaseKVTransport
    from radixmesh.engine.scheduler.core import Scheduler

logger = logging.getLogger(__name__)
Reply = Callable[[str, dict[str, Any]], None]


@dataclass
class Reservation:
    """KV slots held for one prompt's suffix until its KV arrives and the request is committed."""

    reservation_id: str
    query_id: str
    """The ReserveReqMsg to answer when granted."""
    req: Req
    """Holds the row and the locked prefix; `kv_len` is the prefix length until commit."""
    slots: torch.Tensor
    """[suffix_len] int64 slots of prompt positions prefix_len..prompt_len-1."""
    prefix_len: int
    expires_at: float
    granted_at: float = 0.0
    layers_received: list[bool] = field(default_factory=list)
    num_bytes_received: int = 0
    error: str | None = None
    transports: set[str] = field(default_factory=set)
    """Transports whose receives are complete once their `finish` returns."""
    receiving: list[InFlight] = field(default_factory=list)
    """Receives still landing after `receive` returned (polled by `tick`)."""
    done_query: str | None = None
    """A TransferDoneReqMsg waiting for `receiving` to land."""
    slots_host: HostCopy | None = None
    """`slots` on their way to the host, started at the grant (a transport describing them reads these, without
    waiting for the device when the KV arrives)."""

    def host_slots(self) -> npt.NDArray[np.int64] | None:
        if self.slots_host is None:
            return None
        host = self.slots_host.wait()[0]
        assert host is not None, "a host copy of the slots"
        return host.numpy()[: int(self.slots.shape[0])]  # a trimmed reservation keeps its first slots

    @property
    def is_landing(self) -> bool:
        return self.error is None and not all(item.done for item in self.receiving)

    @property
    def is_complete(self) -> bool:
        return (self.error is None and bool(self.layers_received) and all(self.layers_received)
                and all(item.done for item in self.receiving))


@dataclass
class _Pending:
    msg: ReserveReqMsg
    deadline: float


class ReservationManager:
    def __init__(self, scheduler: Scheduler, transport: Callable[[str], BaseKVTransport], reply: Reply,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sched = scheduler
        self.transport = transport
        self.reply = reply
        self.clock = clock
        self.pending: list[_Pending] = []
        self.active: dict[str, Reservation] = {}
        self.counters = {"num_reservations_granted": 0, "num_reservations_lapsed": 0, "num_reservations_refused": 0,
                         "num_committed": 0, "num_fallbacks": 0, "kv_bytes_received": 0, "num_stale_chunks": 0}
        self.fallback_reasons: dict[str, int] = {}
        self.by_transport: dict[str, int] = {}
        """Transfers received, by the transport of their first chunk."""
        self.draining = Draining(lambda slots: self.sched.kv.allocator.free(slots))
        self.receiver_params: Callable[[], bytes] = lambda: b""
        """This side's `ReceiverInfo` (msgpack), sent with each grant for the exporting side (auto, nixl)."""

    @property
    def is_busy(self) -> bool:
        """Receives are landing: the scheduler loop should come back soon even when idle."""
        return bool(self.draining) or any(r.is_landing for r in self.active.values())

    # ---- reserve ----------------------------------------------------------------------------------
    def reserve(self, msg: ReserveReqMsg) -> None:
        """Grant now if KV is free, else queue (granted by `tick` later, or refused at the lease's end)."""
        problem = self._refusal(msg)
        if problem is not None:
            self._refuse(msg, problem)
            return
        self.pending.append(_Pending(msg, self.clock() + msg.lease_s))
        self._grant_pending()

    def _refusal(self, msg: ReserveReqMsg) -> str | None:
        prompt_len, sched = len(msg.input_ids), self.sched
        if sched.config.enable_dp_attention:
            return "prefill/decode disaggregation does not run with --enable-dp-attention yet"
        if prompt_len < 1 or prompt_len >= sched.context_len or prompt_len + 1 > sched.kv.capacity:
            return f"a prompt of {prompt_len} tokens cannot be reserved here"
        if msg.reservation_id in self.active or any(p.msg.reservation_id == msg.reservation_id for p in self.pending):
            return f"reservation {msg.reservation_id} exists already"
        return None

    def _refuse(self, msg: ReserveReqMsg, reason: str) -> None:
        self.counters["num_reservations_refused"] += 1
        self.reply(msg.query_id, {"ok": False, "error": reason})

    def _grant_pending(self) -> None:
        while self.pending:
            granted = self._try_grant(self.pending[0].msg)
            if granted is None:
                return  # first come, first served: later ones wait too
            self.pending.pop(0)
            self.active[granted.reservation_id] = granted
            self.counters["num_reservations_granted"] += 1
            self.reply(granted.query_id, {
                "ok": True, "reservation_id": granted.reservation_id, "prefix_len": granted.prefix_len,
                "num_reserved_tokens": int(granted.slots.shape[0]), "lease_s": granted.expires_at - self.clock(),
                "transport_params": self.receiver_params()})

    def _try_grant(self, msg: ReserveReqMsg) -> Reservation | None:
        sched, kv = self.sched, self.sched.kv
        busy_rows = len(sched.running) + len(self.active) + (1 if sched.prefill.chunked_req is not None else 0)
        if busy_rows >= sched.config.max_running_requests or kv.req_pool.available_size() == 0:
            return None
        req = Req(rid=msg.rid, origin_input_ids=list(msg.input_ids), params=msg.params)
        kv.match(req)
        kv.lock(req)
        suffix_len = len(req.origin_input_ids) - len(req.prefix_indices)
        if kv.available_tokens() - self._decode_reserve() < suffix_len + self._decode_need(req):
            kv.unlock(req)
            return None
        slots = kv.alloc_slots(suffix_len)
        if slots is None or not kv.assign_row(req):
            if slots is not None:
                kv.allocator.free(slots)
            kv.unlock(req)
            return None
        assert req.req_pool_idx is not None
        prefix_len = req.kv_len
        kv.req_pool.write(req.req_pool_idx, prefix_len, slots)
        req.admitted_at = time.time()  # the end of its queue wait, as for a locally prefilled request
        now = self.clock()
        return Reservation(msg.reservation_id, msg.query_id, req, slots, prefix_len, now + msg.lease_s, granted_at=now,
                           layers_received=[False] * sched.runner.kv_pool.num_layers, slots_host=HostCopy([slots]))

    def _decode_need(self, req: Req) -> int:
        return self.sched.decode.need(req)

    def _decode_reserve(self) -> int:
        """Slots running requests and granted reservations are expected to decode into."""
        return self.sched.decode.reserved_tokens() + sum(self._decode_need(r.req) for r in self.active.values())

    # ---- transfer ---------------------------------------------------------------------------------
    def receive(self, msg: KVChunkInMsg) -> None:
        reservation = self.active.get(msg.reservation_id)
        if reservation is None:
            self.counters["num_stale_chunks"] += 1  # lapsed, cancelled or aborted meanwhile
            return
        if reservation.error is not None:
            return
        chunk = msg.chunk
        try:
            pending = self.transport(chunk.transport).receive(chunk, reservation.slots, reservation.host_slots())
        except (RadixMeshError, AssertionError, RuntimeError) as exc:
            reservation.error = f"KV chunk rejected: {exc}"
            logger.warning("reservation %s: %s", reservation.reservation_id, reservation.error)
            return
        if pending is None:
            reservation.transports.add(chunk.transport)
        else:
            reservation.receiving.append(InFlight(pending))
        if not any(reservation.layers_received):
            self.by_transport[chunk.transport] = self.by_transport.get(chunk.transport, 0) + 1
        received = reservation.layers_received
        if any(received[chunk.layer_begin:chunk.layer_end]):
            reservation.error = f"layers [{chunk.layer_begin}, {chunk.layer_end}) were received twice"
            return
        received[chunk.layer_begin:chunk.layer_end] = [True] * (chunk.layer_end - chunk.layer_begin)
        reservation.num_bytes_received += chunk.num_bytes
        self.counters["kv_bytes_received"] += chunk.num_bytes

    def transfer_done(self, msg: TransferDoneReqMsg) -> None:
        """Answer once every chunk so far is in the pool: the prefill side may then release its copy."""
        reservation = self.active.get(msg.reservation_id)
        if reservation is None:
            self.reply(msg.query_id, {"ok": False, "error": "the reservation is gone (lapsed, cancelled or aborted)"})
            return
        self._poll(reservation)
        if reservation.is_landing:
            reservation.done_query = msg.query_id  # answered by `tick` once the receives landed
            return
        self._answer_done(reservation, msg.query_id)

    def _poll(self, reservation: Reservation) -> None:
        if not reservation.is_landing:
            return
        error = poll_receives(reservation.receiving, reservation.granted_at, self.clock())
        if error is not None:
            reservation.error = error
            logger.warning("reservation %s: %s", reservation.reservation_id, error)

    def _answer_done(self, reservation: Reservation, query_id: str) -> None:
        reservation.done_query = None
        for transport_id in reservation.transports:
            self.transport(transport_id).finish()
        error = reservation.error
        if error is None and not reservation.is_complete:
            missing = [i for i, got in enumerate(reservation.layers_received) if not got]
            error = f"KV of {len(missing)} layers did not arrive (first missing: {missing[0]})"
        self.reply(query_id, {"ok": error is None, "error": error or "", "num_bytes": reservation.num_bytes_received})

    # ---- resolve ----------------------------------------------------------------------------------
    def resolve(self, msg: ResolveReservationMsg) -> None:
        """Commit with the received KV and first token, or compute the prompt here."""
        self.cancel(msg.reservation_id, count_lapse=False, keep=True)
        reservation = self.active.pop(msg.reservation_id, None)
        if reservation is not None and reservation.is_complete and msg.first_token >= 0:
            self._commit(reservation, msg)
            return
        reason = msg.fallback_reason or ("lease lapsed" if reservation is None else
                                         reservation.error or "KV incomplete")
        if reservation is not None:
            self.free(reservation)
        self.counters["num_fallbacks"] += 1
        self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1
        logger.info("request %s: computing the prompt here (%s)", msg.rid, reason)
        self.sched.add_request(Req(rid=msg.rid, origin_input_ids=list(msg.input_ids), params=msg.params))

    def _commit(self, reservation: Reservation, msg: ResolveReservationMsg) -> None:
        top = [(int(t), float(lp)) for t, lp in msg.top_logprobs] if msg.top_logprobs is not None else None
        self.counters["num_committed"] += 1
        self.sched.commit_prefilled(reservation.req, msg.cached_tokens, msg.first_token, msg.logprob, top)

    # ---- give up ----------------------------------------------------------------------------------
    def cancel(self, reservation_id: str, count_lapse: bool = False, keep: bool = False) -> None:
        """Drop a pending or granted reservation (a granted one stays when `keep`: resolve takes it)."""
        for pending in [p for p in self.pending if p.msg.reservation_id == reservation_id]:
            self.pending.remove(pending)
            self.reply(pending.msg.query_id, {"ok": False, "error": "cancelled"})
        if not keep and reservation_id in self.active:
            self.free(self.active.pop(reservation_id))
            if count_lapse:
                self.counters["num_reservations_lapsed"] += 1

    def take(self, reservation_id: str) -> Reservation | None:
        """Remove a granted reservation for its owner to commit or free (a pending one is cancelled: None)."""
        self.cancel(reservation_id, keep=True)
        return self.active.pop(reservation_id, None)

    def abort(self, rid: str) -> None:
        for pending in [p for p in self.pending if p.msg.rid == rid]:
            self.cancel(pending.msg.reservation_id)
        for reservation_id in [i for i, r in self.active.items() if r.req.rid == rid]:
            self.cancel(reservation_id)

    def tick(self) -> None:
        """Free lapsed reservations, refuse pending ones past their lease, grant what now fits."""
        for reservation in list(self.active.values()):
            self._poll(reservation)
            if reservation.done_query is not None and not reservation.is_landing:
                self._answer_done(reservation, reservation.done_query)
        self.draining.tick()
        now = self.clock()
        for reservation_id in [i for i, r in self.active.items() if r.expires_at < now]:
            logger.warning("reservation %s lapsed; its slots are freed", reservation_id)
            self.cancel(reservation_id, count_lapse=True)
        for pending in [p for p in self.pending if p.deadline < now]:
            self.pending.remove(pending)
            self._refuse(pending.msg, "no KV slots became free within the lease")
        self._grant_pending()

    def free(self, reservation: Reservation) -> None:
        """Give a taken (or lapsed) reservation's slots, lock and row back."""
        kv, req = self.sched.kv, reservation.req
        if reservation.done_query is not None:
            self.reply(reservation.done_query, {"ok": False, "error": "the reservation was given up"})
            reservation.done_query = None
        self.draining.give_up(reservation.receiving, reservation.slots)  # frees them now, or once nothing lands
        kv.unlock(req)
        if req.req_pool_idx is not None:
            kv.req_pool.free(req.req_pool_idx)
            req.req_pool_idx = None

    def stats(self) -> dict[str, int]:
        return {**self.counters, "num_reservations_active": len(self.active),
                "num_reservations_pending": len(self.pending),
                "num_reserved_tokens": sum(int(r.slots.shape[0]) for r in self.active.values()),
                "num_receives_landing": sum(r.is_landing for r in self.active.values()),
                "num_slots_draining": self.draining.num_slots}
