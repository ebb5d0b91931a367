"""Prefix sharing, fetching side: a reservation filled with a prefix's KV from a peer goes into the radix cache.

The front end reserves slots for the part of the prefix this worker lacks (`ReserveReqMsg`, whose
prompt is the prefix), lands the peer's chunks (`KVChunkInMsg`) and waits for them (`TransferDoneReqMsg`),
exactly as a decode worker does. `CommitFetchMsg` then inserts the prefix into the radix cache (the
tree takes the reserved slots; the request row is freed) and queues the whole prompt as an ordinary
request, which matches the fetched prefix at admission. An incomplete reservation (a layer missing, a
rejected chunk, a lapsed lease) or a fetch that failed is freed instead and the prompt computed here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixmesh.engine.request import Req
from radixmesh.wire.disagg import CommitFetchMsg, PrefixLenReqMsg, TrimReservationMsg

if TYPE_CHECKING:
    from radixmesh.engine.disagg.reservations import ReservationManager
    from radixmesh.engine.scheduler.core import Scheduler

logger = logging.getLogger(__name__)


class FetchCommitter:
    def __init__(self, scheduler: Scheduler, reservations: ReservationManager) -> None:
        self.sched = scheduler
        self.reservations = reservations
        self.counters = {"num_peer_fetch_commits": 0, "peer_fetched_tokens": 0, "num_peer_fetch_fallbacks": 0}
        self.fallback_reasons: dict[str, int] = {}

    def prefix_len(self, msg: PrefixLenReqMsg) -> dict[str, int]:
        """This worker's cached prefix of the ids: on the device, and beyond it in the host tier."""
        from radixmesh.engine.hicache.tree import HiRadixCache

        tree = self.sched.kv.tree
        if self.sched.config.enable_dp_attention:  # its KV is spread over per-rank pools no transport reads yet
            return {"device_len": 0, "host_len": 0}
        if isinstance(tree, HiRadixCache):
            match = tree.match_host(list(msg.input_ids))
            return {"device_len": len(match.device.indices), "host_len": match.host_len}
        return {"device_len": len(tree.match_prefix(list(msg.input_ids)).indices), "host_len": 0}

    def trim(self, msg: TrimReservationMsg) -> None:
        """Shrink a reservation nothing has landed in yet to its first `num_tokens` slots (>= 1)."""
        reservation = self.reservations.active.get(msg.reservation_id)
        if reservation is None or any(reservation.layers_received):
            return  # lapsed meanwhile (the commit falls back), or too late to shrink (the chunk is rejected)
        keep = max(1, min(msg.num_tokens, int(reservation.slots.shape[0])))
        self.sched.kv.allocator.free(reservation.slots[keep:])
        reservation.slots = reservation.slots[:keep]
        req = reservation.req
        req.origin_input_ids = req.origin_input_ids[: reservation.prefix_len + keep]

    def commit(self, msg: CommitFetchMsg) -> None:
        reservation = self.reservations.take(msg.reservation_id)
        if reservation is not None and reservation.is_complete and not msg.fallback_reason:
            req = reservation.req
            fetched_len = len(req.origin_input_ids)
            assert list(msg.input_ids[:fetched_len]) == req.origin_input_ids, "the fetched prefix is not the prompt's"
            req.kv_len = fetched_len
            self.sched.kv.release(req)  # the prefix's KV into the radix cache (evictable), the row freed
            self.counters["num_peer_fetch_commits"] += 1
            self.counters["peer_fetched_tokens"] += fetched_len - reservation.prefix_len
        else:
            reason = msg.fallback_reason or ("lease lapsed" if reservation is None else
                                             reservation.error or "KV incomplete")
            if reservation is not None:
                self.reservations.free(reservation)
            self.counters["num_peer_fetch_fallbacks"] += 1
            self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1
            logger.info("request %s: the fetched prefix is not used (%s); computing it here", msg.rid, reason)
        self.sched.add_request(Req(rid=msg.rid, origin_input_ids=list(msg.input_ids), params=msg.params))

    def stats(self) -> dict[str, int]:
        return dict(self.counters)
