"""Prefix sharing inside the scheduler processes (tiny random model, CPU, grpc transport in memory): worker A
exports a cached prefix, worker B lands it in a reservation, commits it to its radix cache and serves the
request from there, with the same tokens as computing it; what goes wrong falls back to computing."""

from __future__ import annotations

import uuid

from radixmesh.engine.request import Req
from radixmesh.wire.disagg import (
    CancelReservationMsg,
    CommitFetchMsg,
    ExportCachedReqMsg,
    KVChunkInMsg,
    KVExportMsg,
    ReleaseTransferMsg,
    ReserveReqMsg,
    TransferDoneReqMsg,
    TrimReservationMsg,
)
from radixmesh.wire.sampling import SamplingParams

from .scheduler_factory import assert_no_leak, make_requests, run_until_idle
from .test_disagg import LEASE_S, Side, greedy, make_side, unified_tokens


def warm(side: Side, ids: list[int], rid: str = "warm") -> None:
    """Run a prompt on `side` so its radix cache holds it."""
    side.sched.add_request(Req(rid=rid, origin_input_ids=list(ids), params=greedy(2)))
    run_until_idle(side.sched)


def export(peer: Side, rid: str, prefix: list[int], start_pos: int) -> tuple[list[KVExportMsg], int]:
    """A's answer to a FetchKV start: its chunks and where they end."""
    peer.handler.handle(ExportCachedReqMsg(rid, f"tx-{rid}", list(prefix), start_pos, "grpc", LEASE_S))
    chunks = [m for m in peer.exports if m.rid == rid]
    peer.exports[:] = [m for m in peer.exports if m.rid != rid]
    assert peer.out.finish[rid] == "length", peer.out.errors.get(rid)
    return chunks, peer.out.cached[rid]


def fetch(peer: Side, me: Side, rid: str, ids: list[int], want: int, params: SamplingParams) -> dict[str, int]:
    """The whole exchange as worker/peer_fetch.py runs it; returns what happened."""
    grant = me.query(ReserveReqMsg(uuid.uuid4().hex, f"res-{rid}", rid, list(ids[:want]), params, LEASE_S))
    assert grant["ok"], grant
    chunks, end = export(peer, rid, ids[:want], grant["prefix_len"])
    if end <= grant["prefix_len"]:
        me.handler.handle(CancelReservationMsg(grant["reservation_id"]))
        me.handler.handle(CommitFetchMsg(rid, grant["reservation_id"], list(ids), params, "peer holds nothing"))
    else:
        if end < want:
            me.handler.handle(TrimReservationMsg(grant["reservation_id"], end - grant["prefix_len"]))
        for chunk in chunks:
            me.handler.handle(KVChunkInMsg(grant["reservation_id"], chunk.chunk))
        done = me.query(TransferDoneReqMsg(uuid.uuid4().hex, grant["reservation_id"]))
        assert done["ok"], done
        me.handler.handle(CommitFetchMsg(rid, grant["reservation_id"], list(ids), params))
    peer.handler.handle(ReleaseTransferMsg(f"tx-{rid}"))
    run_until_idle(me.sched)
    return {"start": grant["prefix_len"], "end": end}


def test_fetched_prefix_gives_identical_tokens_and_counts_as_cached() -> None:
    a, b = make_side(), make_side()
    for i, req in enumerate(make_requests(3, seed=21, prompt_len=(50, 90))):
        ids, params = req.origin_input_ids, req.params
        warm(a, ids, f"warm{i}")
        got = fetch(a, b, f"r{i}", ids, len(ids) - 1, params)
        assert got == {"start": 0, "end": len(ids) - 1}
        assert b.out.tokens[f"r{i}"] == unified_tokens(ids, params)
        assert b.out.cached[f"r{i}"] == len(ids) - 1
    stats = b.handler.stats()
    assert stats["num_peer_fetch_commits"] == 3 and stats["num_peer_fetch_fallbacks"] == 0
    assert stats["peer_fetched_tokens"] == b.sched.counters.num_cached_tokens
    assert a.handler.stats()["num_cached_exports"] == 3 and a.handler.stats()["num_transfers_held"] == 0
    assert_no_leak(a.sched)
    assert_no_leak(b.sched)


def test_only_the_part_the_fetcher_lacks_moves() -> None:
    a, b = make_side(), make_side()
    ids = make_requests(1, seed=22, prompt_len=(80, 80))[0].origin_input_ids
    warm(a, ids)
    warm(b, ids[:30], "mine")  # b holds the first 30 tokens itself
    got = fetch(a, b, "r", ids, 70, greedy(5))
    assert got == {"start": 30, "end": 70}
    assert b.handler.stats()["peer_fetched_tokens"] == 40
    assert b.out.cached["r"] == 70 and b.out.tokens["r"] == unified_tokens(ids, greedy(5))
    assert_no_leak(a.sched)
    assert_no_leak(b.sched)


def test_a_peer_holding_less_than_asked_sends_what_it_has() -> None:
    a, b = make_side(), make_side()
    ids = make_requests(1, seed=23, prompt_len=(80, 80))[0].origin_input_ids
    warm(a, ids[:50])  # the index was stale: a holds 50 (+ 1 generated) of the 79 asked
    got = fetch(a, b, "r", ids, 79, greedy(4))
    assert got["start"] == 0 and got["end"] == 50
    assert b.out.cached["r"] == 50 and b.out.tokens["r"] == unified_tokens(ids, greedy(4))
    assert_no_leak(a.sched)
    assert_no_leak(b.sched)


def test_a_peer_holding_nothing_falls_back_to_computing() -> None:
    a, b = make_side(), make_side()
    ids = make_requests(1, seed=24, prompt_len=(60, 60))[0].origin_input_ids
    got = fetch(a, b, "r", ids, 59, greedy(4))
    assert got["end"] == 0
    assert b.out.tokens["r"] == unified_tokens(ids, greedy(4)) and b.out.cached["r"] == 0
    assert b.handler.stats()["num_peer_fetch_fallbacks"] == 1
    assert_no_leak(a.sched)
    assert_no_leak(b.sched)


def test_fetch_failing_mid_transfer_frees_the_reservation_and_computes() -> None:
    a, b = make_side(), make_side()
    ids = make_requests(1, seed=25, prompt_len=(60, 60))[0].origin_input_ids
    warm(a, ids)
    grant = b.query(ReserveReqMsg("q", "res-x", "x", ids[:59], greedy(4), LEASE_S))
    chunks, _ = export(a, "x", ids[:59], 0)
    b.handler.handle(KVChunkInMsg("res-x", chunks[0].chunk))  # then the peer "dies": nothing more arrives
    assert grant["ok"] and b.handler.stats()["num_reservations_active"] == 1
    b.handler.handle(CommitFetchMsg("x", "res-x", ids, greedy(4), "peer unavailable"))
    run_until_idle(b.sched)
    assert b.out.tokens["x"] == unified_tokens(ids, greedy(4)) and b.out.cached["x"] == 0
    assert b.handler.stats()["peer_fetch_fallback_reasons"] == {"peer unavailable": 1}
    assert_no_leak(b.sched)
    a.clock.now += LEASE_S + 1  # the release never comes: the lease unlocks the exported KV
    a.handler.tick()
    assert a.handler.stats()["num_transfers_held"] == 0 and a.handler.stats()["num_transfers_lapsed"] == 1
    assert_no_leak(a.sched)


def test_prefix_len_counts_the_host_tier() -> None:
    from radixmesh.wire.disagg import PrefixLenReqMsg

    me = make_side(max_total_tokens=200, enable_hierarchical_cache=True, hicache_ratio=4.0)
    ids = make_requests(1, seed=26, prompt_len=(90, 90))[0].origin_input_ids
    warm(me, ids)
    assert me.query(PrefixLenReqMsg("q1", ids)) == {"device_len": 90, "host_len": 0}
    me.sched.kv.tree.evict(1000)
    held = me.query(PrefixLenReqMsg("q2", ids[:60]))
    assert held == {"device_len": 0, "host_len": 60}
    assert_no_leak(me.sched)
