"""Disaggregation in the scheduler process: a prefill and a decode scheduler (tiny random model, CPU)
joined by the grpc transport in memory, checked against a unified scheduler and for leaks."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest

from radixmesh.engine.disagg.handler import DisaggHandler
from radixmesh.engine.disagg.transport.registry import check_transport_device, create_transport
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.core import Scheduler
from radixmesh.wire.disagg import (
    KVChunkInMsg,
    KVExportMsg,
    PrefillReqMsg,
    ReleaseTransferMsg,
    ReserveReqMsg,
    ResolveReservationMsg,
    TransferDoneReqMsg,
)
from radixmesh.wire.sampling import SamplingParams

from .router_factory import FakeClock
from .scheduler_factory import Collector, assert_no_leak, make_requests, make_scheduler, run_until_idle

LEASE_S = 10.0


@dataclass
class Side:
    """One scheduler with its disaggregation handler, collecting what it sends and replies."""

    sched: Scheduler
    out: Collector
    handler: DisaggHandler
    exports: list[KVExportMsg] = field(default_factory=list)
    replies: dict[str, dict[str, Any]] = field(default_factory=dict)
    clock: FakeClock = field(default_factory=FakeClock)

    def query(self, msg: ReserveReqMsg | TransferDoneReqMsg) -> dict[str, Any]:
        self.handler.handle(msg)
        return self.replies.pop(msg.query_id)


def make_side(**overrides: Any) -> Side:
    sched, out = make_scheduler(**overrides)
    exports: list[KVExportMsg] = []
    replies: dict[str, dict[str, Any]] = {}
    handler = DisaggHandler(sched, exports.append, lambda query_id, result: replies.__setitem__(query_id, result))
    side = Side(sched, out, handler, exports, replies)
    handler.reservations.clock = handler.exports.clock = side.clock
    return side


def greedy(max_new_tokens: int = 10, **params: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **params)


def unified_tokens(ids: list[int], params: SamplingParams) -> list[int]:
    sched, out = make_scheduler()
    sched.add_request(Req(rid="u", origin_input_ids=list(ids), params=params))
    run_until_idle(sched)
    return out.tokens["u"]


def reserve(decode: Side, rid: str, ids: list[int], params: SamplingParams) -> dict[str, Any]:
    return decode.query(ReserveReqMsg(uuid.uuid4().hex, f"res-{rid}", rid, list(ids), params, LEASE_S))


def run_loop(side: Side, max_steps: int = 10_000) -> None:
    """Step as the scheduler loop does (the handler, a hook, ticks at the start of every step)."""
    for _ in range(max_steps):
        if not side.sched.has_work:
            return
        side.sched.step()
    raise AssertionError("scheduler did not finish")


def prefill(prefill_side: Side, rid: str, ids: list[int], params: SamplingParams, start_pos: int) -> list[KVExportMsg]:
    prefill_side.handler.handle(PrefillReqMsg(rid, f"tx-{rid}", list(ids), params, start_pos, "grpc", LEASE_S))
    run_loop(prefill_side)
    chunks = [m for m in prefill_side.exports if m.rid == rid]
    prefill_side.exports[:] = [m for m in prefill_side.exports if m.rid != rid]
    return chunks


def transfer(prefill_side: Side, decode: Side, rid: str, ids: list[int], params: SamplingParams) -> dict[str, Any]:
    """Reserve on decode, prefill and export, land the chunks, commit; returns the reservation reply."""
    grant = reserve(decode, rid, ids, params)
    assert grant["ok"], grant
    chunks = prefill(prefill_side, rid, ids, params, grant["prefix_len"])
    assert chunks and [c.index for c in chunks] == list(range(chunks[0].count))
    for chunk in chunks:
        decode.handler.handle(KVChunkInMsg(grant["reservation_id"], chunk.chunk))
    done = decode.query(TransferDoneReqMsg(uuid.uuid4().hex, grant["reservation_id"]))
    assert done["ok"], done
    assert done["num_bytes"] == sum(c.chunk.num_bytes for c in chunks)
    prefill_side.handler.handle(ReleaseTransferMsg(f"tx-{rid}"))
    first = prefill_side.out.tokens[rid]
    assert len(first) == 1 and prefill_side.out.finish[rid] in ("length", "stop")
    decode.handler.handle(ResolveReservationMsg(rid, grant["reservation_id"], list(ids), params,
                                                first_token=first[0], cached_tokens=prefill_side.out.cached[rid]))
    run_until_idle(decode.sched)
    return {**grant, "num_bytes": done["num_bytes"]}


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_prefill_then_decode_equals_unified_and_leaks_nothing(overlap: str) -> None:
    p, d = make_side(overlap_schedule=overlap), make_side()
    for i, req in enumerate(make_requests(3, seed=5, prompt_len=(6, 30))):
        expected = unified_tokens(req.origin_input_ids, req.params)
        grant = transfer(p, d, f"r{i}", req.origin_input_ids, req.params)
        assert grant["prefix_len"] == 0 and grant["num_reserved_tokens"] == len(req.origin_input_ids)
        assert d.out.tokens[f"r{i}"] == expected
        assert d.out.finish[f"r{i}"] == "length"
    stats = d.handler.stats()
    assert stats["num_committed"] == 3 and stats["num_fallbacks"] == 0 and stats["num_reservations_active"] == 0
    assert p.handler.stats()["num_exports"] == 3 and p.handler.stats()["num_transfers_held"] == 0
    assert_no_leak(d.sched)
    assert_no_leak(p.sched)


def test_second_turn_moves_only_the_new_suffix() -> None:
    p, d = make_side(), make_side()
    params = greedy(6)
    turn1 = make_requests(1, seed=9, prompt_len=(40, 40))[0].origin_input_ids
    first = transfer(p, d, "t1", turn1, params)
    turn2 = turn1 + d.out.tokens["t1"] + [7, 8, 9, 10, 11]
    second = transfer(p, d, "t2", turn2, params)
    # the decode worker's cache holds turn 1 (prompt and output but the last token, whose KV never ran)
    assert second["prefix_len"] == len(turn1) + len(d.out.tokens["t1"]) - 1
    assert second["num_reserved_tokens"] == len(turn2) - second["prefix_len"]
    per_token = first["num_bytes"] // len(turn1)
    assert second["num_bytes"] == per_token * second["num_reserved_tokens"] < first["num_bytes"] / 4
    assert p.out.cached["t2"] >= len(turn1)  # the prefill worker reused its own cache too
    assert d.out.tokens["t2"] == unified_tokens(turn2, params)
    assert_no_leak(d.sched)


def test_lapsed_reservation_frees_its_slots_and_resolve_computes_locally() -> None:
    p, d = make_side(), make_side()
    ids, params = make_requests(1, seed=3, prompt_len=(20, 20))[0].origin_input_ids, greedy(5)
    grant = reserve(d, "x", ids, params)
    assert grant["ok"] and d.sched.kv.used_tokens() == len(ids)
    d.clock.now += LEASE_S + 1
    d.handler.tick()
    assert d.handler.stats()["num_reservations_lapsed"] == 1
    assert_no_leak(d.sched)
    chunks = prefill(p, "x", ids, params, 0)
    d.handler.handle(KVChunkInMsg(grant["reservation_id"], chunks[0].chunk))  # too late: dropped
    assert d.handler.stats()["num_stale_chunks"] == 1
    d.handler.handle(ResolveReservationMsg("x", grant["reservation_id"], list(ids), params,
                                           first_token=p.out.tokens["x"][0]))
    run_until_idle(d.sched)
    assert d.out.tokens["x"] == unified_tokens(ids, params)
    assert d.handler.reservations.fallback_reasons == {"lease lapsed": 1}
    assert_no_leak(d.sched)


def test_incomplete_transfer_falls_back_and_is_reported() -> None:
    p, d = make_side(), make_side()
    ids, params = make_requests(1, seed=4, prompt_len=(16, 16))[0].origin_input_ids, greedy(4)
    grant = reserve(d, "y", ids, params)
    p.handler.exports.transport("grpc").max_chunk_bytes = 1  # one layer per chunk
    chunks = prefill(p, "y", ids, params, grant["prefix_len"])
    assert len(chunks) == d.sched.runner.kv_pool.num_layers > 1
    d.handler.handle(KVChunkInMsg(grant["reservation_id"], chunks[0].chunk))
    done = d.query(TransferDoneReqMsg(uuid.uuid4().hex, grant["reservation_id"]))
    assert not done["ok"] and "did not arrive" in done["error"]
    d.handler.handle(ResolveReservationMsg("y", grant["reservation_id"], list(ids), params,
                                           first_token=p.out.tokens["y"][0]))
    run_until_idle(d.sched)
    assert d.out.tokens["y"] == unified_tokens(ids, params)
    assert d.handler.stats()["num_fallbacks"] == 1
    assert_no_leak(d.sched)
    p.handler.handle(ReleaseTransferMsg("tx-y"))
    assert_no_leak(p.sched)


def test_a_chunk_of_another_shape_is_rejected() -> None:
    p, d = make_side(), make_side()
    ids, params = make_requests(1, seed=6, prompt_len=(12, 12))[0].origin_input_ids, greedy(3)
    grant = reserve(d, "z", ids, params)
    chunks = prefill(p, "z", ids[:-2], params, 0)  # two tokens short of the reservation
    d.handler.handle(KVChunkInMsg(grant["reservation_id"], chunks[0].chunk))
    done = d.query(TransferDoneReqMsg(uuid.uuid4().hex, grant["reservation_id"]))
    assert not done["ok"] and "slots are reserved" in done["error"]
    d.handler.handle(ResolveReservationMsg("z", grant["reservation_id"], list(ids), params, fallback_reason="test"))
    run_until_idle(d.sched)
    assert d.handler.reservations.fallback_reasons == {"test": 1}
    assert_no_leak(d.sched)


def test_reservation_waits_for_kv_and_is_refused_at_its_lease() -> None:
    d = make_side(max_total_tokens=64)
    params = greedy(4)
    big = reserve(d, "big", list(range(1, 41)), params)
    assert big["ok"]
    query_id = uuid.uuid4().hex
    d.handler.handle(ReserveReqMsg(query_id, "res-wait", "wait", list(range(2, 32)), params, LEASE_S))
    assert query_id not in d.replies and d.handler.stats()["num_reservations_pending"] == 1
    d.handler.reservations.cancel(big["reservation_id"])  # frees 40 slots
    d.handler.tick()
    assert d.replies.pop(query_id)["ok"]
    d.handler.handle(ReserveReqMsg(query_id, "res-late", "late", list(range(3, 43)), params, LEASE_S))
    d.clock.now += LEASE_S + 1
    d.handler.tick()  # the granted one lapses; the pending one is refused at its deadline
    reply = d.replies.pop(query_id)
    assert not reply["ok"] and "within the lease" in reply["error"]
    assert d.handler.stats()["num_reservations_refused"] == 1
    assert_no_leak(d.sched)


def test_abort_reaches_reservations_and_exports() -> None:
    p, d = make_side(), make_side()
    ids, params = make_requests(1, seed=8, prompt_len=(10, 10))[0].origin_input_ids, greedy(3)
    reserve(d, "a", ids, params)
    d.handler.abort("a")
    assert_no_leak(d.sched)
    prefill(p, "a", ids, params, 0)
    assert p.handler.stats()["num_transfers_held"] == 1 and p.sched.kv.used_tokens() > 0
    p.handler.abort("a")
    assert_no_leak(p.sched)
    p.handler.handle(PrefillReqMsg("b", "tx-b", list(ids), params, 0, "grpc", LEASE_S))
    p.sched.abort("b")
    p.handler.abort("b")
    run_until_idle(p.sched)
    assert p.out.finish["b"] == "abort" and not p.exports
    assert_no_leak(p.sched)


def test_exported_kv_is_released_by_its_lease() -> None:
    p = make_side()
    ids, params = make_requests(1, seed=2, prompt_len=(10, 10))[0].origin_input_ids, greedy(3)
    prefill(p, "l", ids, params, 4)
    assert p.sched.kv.tree.protected_size() == len(ids)
    p.clock.now += LEASE_S + 1
    p.handler.tick()
    assert p.handler.stats()["num_transfers_lapsed"] == 1
    assert_no_leak(p.sched)


def test_overlap_queues_each_export_before_the_next_pass_and_sends_it_with_the_first_token(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Under overlap a pass's tokens are read back after the next pass was launched. An export queued then
    # runs on the GPU behind that whole next pass, and so does the decode worker's copy (cuda-ipc waits on
    # the gather's event on the decode GPU's stream): its decode steps stall for a prefill pass.
    p = make_side(overlap_schedule="on", chunked_prefill_size=64)
    events: list[tuple[str, str]] = []
    launch, transport, exports = p.sched.runner.launch, p.handler.transport("grpc"), p.handler.exports
    export, send, emit = transport.export, exports.send, p.handler._emit

    def traced_launch(batch: Any, before_sample: Any) -> Any:
        events.append(("launch", ",".join(req.rid for req in batch.reqs)))
        return launch(batch, before_sample)

    def traced_export(transfer_id: str, slots: Any, receiver: Any = None) -> Any:
        events.append(("export", transfer_id.removeprefix("tx-")))
        return export(transfer_id, slots, receiver)

    def traced_send(msg: KVExportMsg) -> None:
        events.append(("send", msg.rid))
        send(msg)

    def traced_emit(outputs: list[Any]) -> None:
        events.extend(("token", out.rid) for out in outputs if out.token_ids)
        emit(outputs)

    monkeypatch.setattr(p.sched.runner, "launch", traced_launch)
    monkeypatch.setattr(transport, "export", traced_export)
    monkeypatch.setattr(exports, "send", traced_send)
    monkeypatch.setattr(p.handler, "_emit", traced_emit)
    reqs = make_requests(6, seed=1, prompt_len=(40, 60))
    for i, req in enumerate(reqs):
        p.handler.handle(PrefillReqMsg(f"p{i}", f"tx-p{i}", req.origin_input_ids, greedy(5), 0, "grpc", LEASE_S))
    run_loop(p)
    passes = [at for at, (kind, _) in enumerate(events) if kind == "launch"]
    assert len(passes) == 5, "six prompts of 40-60 tokens pack into 5 passes of 64 tokens"
    for i in range(len(reqs)):
        rid = f"p{i}"
        last_pass = max(at for at in passes if rid in events[at][1].split(","))
        next_pass = min((at for at in passes if at > last_pass), default=len(events))
        exported, sent = events.index(("export", rid)), events.index(("send", rid))
        assert last_pass < exported < next_pass, f"{rid}: KV gathered behind the next pass: {events}"
        assert next_pass < sent or next_pass == len(events), f"{rid}: chunks sent while its pass ran: {events}"
        assert sent < events.index(("token", rid)), f"{rid}: first token ahead of its KV"
        assert p.out.finish[rid] in ("length", "stop") and len(p.out.tokens[rid]) == 1
    reference = make_side()
    for i, req in enumerate(reqs):
        prefill(reference, f"p{i}", req.origin_input_ids, greedy(5), 0)
        assert reference.out.tokens[f"p{i}"] == p.out.tokens[f"p{i}"]
        p.handler.handle(ReleaseTransferMsg(f"tx-p{i}"))
    assert exports.stats()["num_exports"] == 6 and not exports.staged
    assert_no_leak(p.sched)


def test_a_prompt_aborted_after_its_export_was_queued_sends_nothing_and_leaks_nothing() -> None:
    p = make_side(overlap_schedule="on")
    ids = make_requests(1, seed=7, prompt_len=(30, 30))[0].origin_input_ids
    p.handler.handle(PrefillReqMsg("s", "tx-s", list(ids), greedy(3), 0, "grpc", LEASE_S))
    p.sched.step()  # launches the prompt's pass
    p.handler.tick()  # queues its export (as the next step's start would)
    assert "s" in p.handler.exports.staged and p.handler.stats()["num_transfers_held"] == 1
    p.sched.abort("s")  # the handler, a hook, drops its export too
    run_loop(p)
    assert p.out.finish["s"] == "abort" and not p.exports
    assert p.handler.stats()["num_transfers_held"] == 0 and not p.handler.exports.staged
    assert_no_leak(p.sched)


@pytest.mark.parametrize(("start_pos", "transport", "error"), [(10, "grpc", "outside the prompt"),
                                                                (0, "rdma", "unknown KV transport")])
def test_bad_prefill_requests_fail_cleanly(start_pos: int, transport: str, error: str) -> None:
    p = make_side()
    p.handler.handle(PrefillReqMsg("bad", "tx", list(range(1, 11)), greedy(), start_pos, transport, LEASE_S))
    assert p.out.finish["bad"] == "error" and error in p.out.errors["bad"]
    assert_no_leak(p.sched)


def test_transport_registry_checks_devices() -> None:
    check_transport_device("grpc", "cpu")
    with pytest.raises(Exception, match="needs the KV pool on cuda"):
        check_transport_device("cuda-ipc", "cpu")
    sched, _ = make_scheduler()
    with pytest.raises(Exception, match="CUDA device"):
        create_transport("cuda-ipc", sched.runner.kv_pool)


@pytest.mark.parametrize(("fields", "param"), [({"kv_transport": "rdma"}, "kv_transport"),
                                               ({"role": "decode", "kv_lease_s": 10, "prefill_timeout_s": 10},
                                                "prefill_timeout_s"),
                                               ({"kv_lease_s": 0}, "kv_lease_s")])
def test_worker_disaggregation_settings_are_checked(fields: dict[str, Any], param: str) -> None:
    from radixmesh.common.errors import RadixMeshError
    from radixmesh.worker.config import WorkerConfig

    with pytest.raises(RadixMeshError) as err:
        WorkerConfig(**fields)
    assert err.value.param == param
    WorkerConfig(role="prefill", kv_transport="cuda-ipc", kv_lease_s=10, prefill_timeout_s=10)  # decode's rule only
