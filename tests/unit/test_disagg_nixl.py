"""Disaggregation in the scheduler process over the nixl transport (the real library, two agents in this process):
auto picks nixl between two CPU schedulers, the decode side polls the READ instead of blocking, KV that lands
after the exporter's lease is rejected, and a reservation given up while a receive runs keeps its slots until
nothing writes them."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import pytest
import torch

from radixmesh.engine.disagg.transport import nixl_lib
from radixmesh.engine.disagg.transport.base import BaseKVTransport, PendingReceive
from radixmesh.engine.disagg.transport.choice import ReceiverInfo, decode_receiver_info
from radixmesh.wire.disagg import (
    KVChunk,
    KVChunkInMsg,
    KVExportMsg,
    PrefillReqMsg,
    ReleaseTransferMsg,
    ResolveReservationMsg,
    TransferDoneReqMsg,
)
from radixmesh.wire.sampling import SamplingParams

from .scheduler_factory import assert_no_leak, make_requests, run_until_idle
from .test_disagg import LEASE_S, Side, greedy, make_side, reserve, run_loop, unified_tokens

pytestmark = pytest.mark.skipif(not nixl_lib.nixl_available(), reason="NIXL is not installed (radixmesh[nixl])")
WAIT_S = 30.0


def prefill_auto(p: Side, rid: str, ids: list[int], params: SamplingParams, grant: dict[str, Any],
                 lease_s: float = LEASE_S) -> list[KVExportMsg]:
    p.handler.handle(PrefillReqMsg(rid, f"tx-{rid}", list(ids), params, grant["prefix_len"], "auto", lease_s,
                                   grant["transport_params"]))
    run_loop(p)
    chunks = [m for m in p.exports if m.rid == rid]
    p.exports[:] = [m for m in p.exports if m.rid != rid]
    return chunks


def transfer_done(d: Side, reservation_id: str) -> dict[str, Any]:
    """Ask, then run the decode side's loop (its tick polls the receives) until it answers."""
    query = TransferDoneReqMsg(uuid.uuid4().hex, reservation_id)
    d.handler.handle(query)
    deadline = time.monotonic() + WAIT_S
    while query.query_id not in d.replies:
        assert time.monotonic() < deadline, "transfer_done was never answered"
        d.handler.tick()
    return d.replies.pop(query.query_id)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_auto_moves_kv_over_nixl_and_the_decode_side_continues_as_unified(overlap: str,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="radixmesh.engine.disagg.exports")
    p, d = make_side(overlap_schedule=overlap), make_side()
    for i, req in enumerate(make_requests(3, seed=11, prompt_len=(8, 40))):
        rid, ids = f"n{i}", req.origin_input_ids
        grant = reserve(d, rid, ids, req.params)
        info = decode_receiver_info(grant["transport_params"])
        assert info is not None and info.has_nixl and info.device_type == "cpu"
        chunks = prefill_auto(p, rid, ids, req.params, grant)
        assert [c.chunk.transport for c in chunks] == ["nixl"] and chunks[0].chunk.lease_s == LEASE_S
        d.handler.handle(KVChunkInMsg(grant["reservation_id"], chunks[0].chunk))
        done = transfer_done(d, grant["reservation_id"])
        assert done["ok"] and done["num_bytes"] == chunks[0].chunk.num_bytes
        p.handler.handle(ReleaseTransferMsg(f"tx-{rid}"))
        d.handler.handle(ResolveReservationMsg(rid, grant["reservation_id"], list(ids), req.params,
                                               first_token=p.out.tokens[rid][0]))
        run_until_idle(d.sched)
        assert d.out.tokens[rid] == unified_tokens(ids, req.params)
    d_stats, p_stats = d.handler.stats(), p.handler.stats()
    assert d_stats["kv_transfers_received"] == {"nixl": 3} and p_stats["kv_transfers_sent"] == {"nixl": 3}
    assert d_stats["num_committed"] == 3 and d_stats["num_fallbacks"] == 0 and d_stats["num_receives_landing"] == 0
    assert p_stats["nixl_metadata_sent"] == 1  # the later grants named the prefill agent as known
    choices = [r.getMessage() for r in caplog.records if "KV transport auto" in r.getMessage()]
    assert len(choices) == 1 and choices[0].startswith("KV transport auto: nixl for receivers on "), choices
    assert d_stats["nixl_staging_regions"] == p_stats["nixl_staging_regions"] == 0
    assert d_stats["nixl_reads_in_flight"] == 0
    assert_no_leak(d.sched)
    assert_no_leak(p.sched)


def test_kv_read_after_the_exporters_lease_is_rejected_and_the_prompt_computed_here() -> None:
    p, d = make_side(), make_side()
    req = make_requests(1, seed=12, prompt_len=(24, 24))[0]
    grant = reserve(d, "late", req.origin_input_ids, req.params)
    chunks = prefill_auto(p, "late", req.origin_input_ids, req.params, grant, lease_s=1.0)
    d.clock.now += 1.0  # the prefill worker may reuse the rows from now on; the decode side's own lease runs on
    d.handler.handle(KVChunkInMsg(grant["reservation_id"], chunks[0].chunk))
    done = transfer_done(d, grant["reservation_id"])
    assert not done["ok"] and "lease of 1 s ran out" in done["error"]
    d.handler.handle(ResolveReservationMsg("late", grant["reservation_id"], list(req.origin_input_ids), req.params,
                                           first_token=p.out.tokens["late"][0]))
    run_until_idle(d.sched)
    assert d.out.tokens["late"] == unified_tokens(req.origin_input_ids, req.params)
    assert d.handler.stats()["num_fallbacks"] == 1
    p.clock.now += 2.0
    p.handler.tick()  # the prefill side's lease lapses too
    assert p.handler.stats()["num_transfers_lapsed"] == 1
    assert_no_leak(d.sched)
    assert_no_leak(p.sched)
    assert d.handler.stats()["nixl_reads_in_flight"] == 0 and p.handler.stats()["nixl_staging_regions"] == 0


class StuckReceive(PendingReceive):
    """A receive that cannot be cancelled and ends only when told to."""

    def __init__(self) -> None:
        self.finished = False

    def poll(self) -> bool:
        return self.finished

    def cancel(self) -> bool:
        return self.finished


class StuckTransport(BaseKVTransport):
    transport_id = "stuck"

    def __init__(self, pool: Any) -> None:
        super().__init__(pool)
        self.receives: list[StuckReceive] = []

    def export(self, transfer_id: str, slots: torch.Tensor, receiver: ReceiverInfo | None = None) -> list[KVChunk]:
        raise AssertionError("receive only")

    def receive(self, chunk: KVChunk, slots: torch.Tensor, host_slots: Any = None) -> PendingReceive | None:
        self.check_chunk(chunk, int(slots.shape[0]))
        self.receives.append(StuckReceive())
        return self.receives[-1]


def test_a_reservation_given_up_while_a_receive_runs_keeps_its_slots_until_it_ends() -> None:
    d = make_side()
    stuck = StuckTransport(d.sched.runner.kv_transfer_pool)
    d.handler._transports["stuck"] = stuck
    ids, params = make_requests(1, seed=13, prompt_len=(16, 16))[0].origin_input_ids, greedy(3)
    grant = reserve(d, "s", ids, params)
    pool = d.sched.runner.kv_pool
    chunk = KVChunk("stuck", 0, pool.num_layers, len(ids), "float32", b"", 0)
    d.handler.handle(KVChunkInMsg(grant["reservation_id"], chunk))
    query = TransferDoneReqMsg(uuid.uuid4().hex, grant["reservation_id"])
    d.handler.handle(query)
    d.handler.tick()
    assert query.query_id not in d.replies and d.handler.is_busy  # waiting for the receive, not blocking
    d.clock.now += LEASE_S + 1
    d.handler.tick()  # the reservation lapses: the receive cannot be stopped, so its slots wait
    assert d.replies.pop(query.query_id)["ok"] is False
    stats = d.handler.stats()
    assert stats["num_reservations_active"] == 0 and stats["num_slots_draining"] == len(ids)
    assert d.sched.kv.allocator.available_size() < d.sched.kv.capacity
    stuck.receives[0].finished = True
    d.handler.tick()
    assert d.handler.stats()["num_slots_draining"] == 0 and not d.handler.is_busy
    d.handler.handle(ResolveReservationMsg("s", grant["reservation_id"], list(ids), params, first_token=5))
    run_until_idle(d.sched)
    assert d.out.tokens["s"] == unified_tokens(ids, params)  # computed here after all
    assert_no_leak(d.sched)
