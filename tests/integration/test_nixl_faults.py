"""Faults of a nixl KV transfer, each with the real library between two processes over UCX's TCP transport on
127.0.0.1 (UCX_TLS=tcp, UCX_NET_DEVICES=lo: the stand-in for a link between nodes): the prefill side killed
while the decode side READs, the decode side killed while the prefill side serves its READ, a prefill agent
that cannot be reached, and a READ still running when the prefill side's lease ends.

A side is stopped (SIGSTOP) to hold a READ in flight: over TCP the READ needs both sides' UCX progress. Each
time the request still completes (the decode side computes the prompt itself), nothing stays held on either
side (KV slots, request rows, staging regions, READs in flight, loaded agents), and the side that survived
moves KV correctly afterwards.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from radixmesh.engine.disagg.bench_transfer_peer import fingerprint
from radixmesh.engine.disagg.transport import nixl_lib
from radixmesh.wire.disagg import (
    CancelReservationMsg,
    KVChunk,
    KVChunkInMsg,
    PrefillReqMsg,
    ResolveReservationMsg,
    TransferDoneReqMsg,
)
from tests.integration.nixl_side import NixlSide, PoolShape
from tests.unit.scheduler_factory import assert_no_leak, make_requests, run_until_idle, tiny_model_config
from tests.unit.test_disagg import LEASE_S, Side, greedy, make_side, reserve, run_loop, unified_tokens

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not nixl_lib.nixl_available(), reason="NIXL is not installed (radixmesh[nixl])")]
TINY = PoolShape(num_layers=2, kv_heads=2, head_dim=8)
"""The KV shape of the scheduler factory's tiny model."""
WAIT_S = 45.0


@pytest.fixture(autouse=True)
def ucx_over_loopback_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


@pytest.fixture
def sides() -> Iterator[list[NixlSide]]:
    started: list[NixlSide] = []
    yield started
    for side in started:
        side.close()


def start(sides: list[NixlSide], shape: PoolShape = TINY, seed: int = 0) -> NixlSide:
    sides.append(NixlSide(shape, seed))
    return sides[-1]


def ask_done(d: Side, reservation_id: str) -> str:
    query = TransferDoneReqMsg(uuid.uuid4().hex, reservation_id)
    d.handler.handle(query)
    return query.query_id


def tick_until_answered(d: Side, query_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while query_id not in d.replies:
        assert time.monotonic() < deadline, "the decode side never answered transfer_done"
        d.handler.tick()
        time.sleep(0.002)
    return d.replies.pop(query_id)


def still_landing(d: Side, query_id: str, seconds: float = 0.5) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        d.handler.tick()
        if query_id in d.replies:
            return False
    return d.handler.stats()["num_receives_landing"] == 1


def fall_back_and_check(d: Side, rid: str, ids: list[int], grant: dict[str, Any]) -> None:
    """Resolve as the front end does after a failed transfer; the prompt is computed here, nothing leaks."""
    d.handler.handle(ResolveReservationMsg(rid, grant["reservation_id"], list(ids), greedy(4), first_token=7))
    run_until_idle(d.sched)
    assert d.out.tokens[rid] == unified_tokens(ids, greedy(4))
    assert d.handler.stats()["num_fallbacks"] >= 1
    assert_no_leak(d.sched)
    stats = d.handler.stats()
    assert stats["nixl_reads_in_flight"] == 0 and stats["nixl_staging_regions"] == 0
    assert stats["num_slots_draining"] == 0 and stats["num_reservations_active"] == 0


def still_receives(d: Side, sides: list[NixlSide], seed: int) -> None:
    """The decode side moves KV correctly from a fresh prefill side (and gives the slots back)."""
    peer = start(sides, seed=seed)
    ids = make_requests(1, seed=seed, prompt_len=(64, 64))[0].origin_input_ids
    grant = reserve(d, f"after-{seed}", ids, greedy(4))
    src = torch.randperm(TINY.size)[:len(ids)] + 1
    chunk = peer.call("export", "tx-after", src.tolist(), grant["transport_params"], LEASE_S)
    d.handler.handle(KVChunkInMsg(grant["reservation_id"], chunk))
    assert tick_until_answered(d, ask_done(d, grant["reservation_id"]))["ok"]
    slots = d.handler.reservations.active[grant["reservation_id"]].slots
    assert fingerprint(d.sched.runner.kv_pool, slots) == peer.call("fingerprint", src.tolist())
    d.handler.handle(CancelReservationMsg(grant["reservation_id"]))
    peer.call("release", "tx-after")
    assert_no_leak(d.sched)


def export_to(d: Side, peer: NixlSide, rid: str, lease_s: float = LEASE_S) -> tuple[list[int], dict[str, Any], KVChunk]:
    ids = make_requests(1, seed=len(rid), prompt_len=(120, 120))[0].origin_input_ids
    grant = reserve(d, rid, ids, greedy(4))
    src = torch.randperm(TINY.size)[:len(ids)] + 1
    return ids, grant, peer.call("export", f"tx-{rid}", src.tolist(), grant["transport_params"], lease_s)


def test_prefill_side_killed_mid_read(sides: list[NixlSide]) -> None:
    d, peer = make_side(), start(sides)
    ids, grant, chunk = export_to(d, peer, "killed-p")
    peer.stop()  # its UCX answers nothing from now on: the READ stays in flight
    d.handler.handle(KVChunkInMsg(grant["reservation_id"], chunk))
    query_id = ask_done(d, grant["reservation_id"])
    assert still_landing(d, query_id), "the READ should wait for the stopped prefill side"
    peer.kill()
    done = tick_until_answered(d, query_id)
    assert not done["ok"] and "NIXL READ" in done["error"], done
    fall_back_and_check(d, "killed-p", ids, grant)
    assert d.handler.stats()["nixl_remote_agents"] == 0  # the dead agent was dropped
    still_receives(d, sides, seed=21)


def test_decode_side_killed_mid_read(sides: list[NixlSide]) -> None:
    # the prefill side is a scheduler here (its export held by the radix lock); the decode side READs one row
    # per descriptor (mode direct, scattered slots): thousands of gets that take a while over TCP
    big = tiny_model_config(num_layers=8, num_heads=8, num_kv_heads=8, head_dim=64)
    p = make_side(model_config=big)
    shape = PoolShape(num_layers=8, kv_heads=8, head_dim=64, size=2048, mode="direct")
    d_peer = start(sides, shape)
    ids = make_requests(1, seed=31, prompt_len=(200, 200))[0].origin_input_ids
    p.handler.handle(PrefillReqMsg("killed-d", "tx-killed-d", list(ids), greedy(4), 0, "auto", LEASE_S,
                                   d_peer.call("info")))
    run_loop(p)
    (export,) = [m for m in p.exports if m.rid == "killed-d"]
    assert export.chunk.transport == "nixl" and p.handler.stats()["num_transfers_held"] == 1
    slots = (torch.randperm(shape.size)[:len(ids)] + 1).tolist()
    assert d_peer.call("receive", export.chunk, slots) == "posted"
    d_peer.stop()
    d_peer.kill()
    p.clock.now += LEASE_S + 1  # no release comes: the lease frees the export
    p.handler.tick()
    stats = p.handler.stats()
    assert stats["num_transfers_held"] == 0 and stats["num_transfers_lapsed"] == 1
    assert stats["nixl_staging_regions"] == 0
    assert_no_leak(p.sched)
    # the prefill side keeps serving: a new decode side READs the next prompt's KV exactly
    d2 = start(sides, shape, seed=1)
    ids2 = make_requests(1, seed=32, prompt_len=(150, 150))[0].origin_input_ids
    p.handler.handle(PrefillReqMsg("next", "tx-next", list(ids2), greedy(4), 0, "nixl", LEASE_S, d2.call("info")))
    run_loop(p)
    (export2,) = [m for m in p.exports if m.rid == "next"]
    slots2 = (torch.randperm(shape.size)[:len(ids2)] + 1).tolist()
    assert d2.call("receive", export2.chunk, slots2) in ("posted", "done")
    assert d2.call("wait") == "done"
    p_slots = p.sched.kv.tree.match_prefix(list(ids2)).indices
    assert d2.call("fingerprint", slots2) == fingerprint(p.sched.runner.kv_pool, p_slots)


def test_unreachable_prefill_agent(sides: list[NixlSide]) -> None:
    d, peer = make_side(), start(sides)
    ids, grant, chunk = export_to(d, peer, "unreachable")
    peer.kill()  # its metadata names a UCX address nobody listens on any more; never connected before
    d.handler.handle(KVChunkInMsg(grant["reservation_id"], chunk))
    done = tick_until_answered(d, ask_done(d, grant["reservation_id"]))
    assert not done["ok"] and "NIXL" in done["error"], done
    fall_back_and_check(d, "unreachable", ids, grant)
    assert d.handler.stats()["nixl_remote_agents"] == 0
    still_receives(d, sides, seed=41)


def test_read_past_the_prefill_sides_lease(sides: list[NixlSide]) -> None:
    d, peer = make_side(), start(sides)
    ids, grant, chunk = export_to(d, peer, "past-lease", lease_s=2.0)
    peer.stop()
    d.handler.handle(KVChunkInMsg(grant["reservation_id"], chunk))
    query_id = ask_done(d, grant["reservation_id"])
    assert still_landing(d, query_id)
    d.clock.now += 2.0  # the prefill side may reuse the rows now; the READ has not finished
    done = tick_until_answered(d, query_id)
    assert not done["ok"] and "lease of 2 s ran out" in done["error"], done
    peer.resume()  # whatever the cancelled READ still does, its slots wait for it (draining) if it could not stop
    deadline = time.monotonic() + WAIT_S
    while d.handler.stats()["num_slots_draining"]:
        assert time.monotonic() < deadline, "the READ never ended"
        d.handler.tick()
    fall_back_and_check(d, "past-lease", ids, grant)
    peer.call("release", "tx-past-lease")
    assert peer.call("stats")["nixl_staging_regions"] == 0
    still_receives(d, sides, seed=51)
