"""The decode side's reservations on their own (engine/disagg/reservations.py), over a real tiny scheduler reached
only through its public API: grants in arrival order, refusals, leases, chunks, and the commit or fallback."""

from __future__ import annotations

import uuid
from typing import Any

import torch

from radixmesh.engine.disagg.reservations import ReservationManager
from radixmesh.engine.disagg.transport.registry import create_transport
from radixmesh.engine.request import Req
from radixmesh.wire.disagg import (
    KVChunk,
    KVChunkInMsg,
    ReserveReqMsg,
    ResolveReservationMsg,
    TransferDoneReqMsg,
)
from radixmesh.wire.sampling import SamplingParams

from .router_factory import FakeClock
from .scheduler_factory import assert_no_leak, make_scheduler, run_until_idle

LEASE_S = 5.0


class Desk:
    """A decode scheduler with its reservations, the replies it sent, and a clock."""

    def __init__(self, **overrides: Any) -> None:
        self.sched, self.out = make_scheduler(**overrides)
        self.replies: dict[str, dict[str, Any]] = {}
        self.clock = FakeClock()
        self.transports: dict[str, Any] = {}
        self.manager = ReservationManager(self.sched, self.transport, self.replies.__setitem__, self.clock)

    def transport(self, transport_id: str) -> Any:
        if transport_id not in self.transports:
            self.transports[transport_id] = create_transport(transport_id, self.sched.runner.kv_transfer_pool)
        return self.transports[transport_id]

    def reserve(self, rid: str, ids: list[int], max_new_tokens: int = 4, reservation_id: str | None = None,
                lease_s: float = LEASE_S) -> dict[str, Any] | None:
        query = uuid.uuid4().hex
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        self.manager.reserve(ReserveReqMsg(query, reservation_id or f"res-{rid}", rid, list(ids), params, lease_s))
        return self.replies.pop(query, None)

    def chunk(self, layer_begin: int, layer_end: int, num_tokens: int) -> KVChunk:
        """A grpc chunk of zeros for `num_tokens` tokens of layers [layer_begin, layer_end)."""
        pool = self.sched.runner.kv_transfer_pool
        per_layer = 2 * num_tokens * pool.num_kv_heads * pool.head_dim * pool.dtype.itemsize
        data = bytes(per_layer * (layer_end - layer_begin))
        return KVChunk("grpc", layer_begin, layer_end, num_tokens, str(pool.dtype).removeprefix("torch."), data,
                       len(data))

    def done(self, reservation_id: str) -> dict[str, Any]:
        query = uuid.uuid4().hex
        self.manager.transfer_done(TransferDoneReqMsg(query, reservation_id))
        return self.replies.pop(query)


def ids(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def test_a_grant_holds_slots_for_the_uncached_suffix() -> None:
    desk = Desk()
    grant = desk.reserve("a", ids(12))
    assert grant is not None and grant["ok"] and grant["prefix_len"] == 0 and grant["num_reserved_tokens"] == 12
    assert grant["lease_s"] == LEASE_S and desk.sched.kv.used_tokens() == 12
    assert desk.manager.stats()["num_reservations_active"] == 1
    desk.manager.cancel("res-a")
    assert_no_leak(desk.sched)


def test_what_the_decode_worker_holds_already_is_not_reserved_again() -> None:
    desk = Desk()
    desk.sched.add_request(Req(rid="warm", origin_input_ids=ids(10), params=SamplingParams(max_new_tokens=1)))
    run_until_idle(desk.sched)  # a unified request left its prompt in the cache
    grant = desk.reserve("b", ids(14))
    assert grant is not None and grant["prefix_len"] == 10 and grant["num_reserved_tokens"] == 4
    desk.manager.cancel("res-b")
    assert_no_leak(desk.sched)


def test_prompts_that_cannot_be_reserved_are_refused_by_reason() -> None:
    desk = Desk(max_total_tokens=64)
    assert desk.reserve("empty", []) == {"ok": False, "error": "a prompt of 0 tokens cannot be reserved here"}
    too_long = desk.reserve("long", ids(300))
    assert too_long is not None and not too_long["ok"]
    assert desk.reserve("a", ids(4)) is not None
    twice = desk.reserve("a2", ids(4, 50), reservation_id="res-a")
    assert twice == {"ok": False, "error": "reservation res-a exists already"}
    assert desk.manager.stats()["num_reservations_refused"] == 3


def test_grants_wait_in_arrival_order_for_kv_and_are_refused_at_their_lease() -> None:
    desk = Desk(max_total_tokens=40)
    first = desk.reserve("a", ids(30), max_new_tokens=2)
    assert first is not None and first["ok"]
    assert desk.reserve("b", ids(20, 100), max_new_tokens=2) is None  # no room: queued, unanswered
    assert desk.reserve("c", ids(2, 200), max_new_tokens=2) is None  # would fit, but b came first
    assert desk.manager.stats()["num_reservations_pending"] == 2
    desk.manager.cancel("res-a")  # room now: both granted at the next tick, in order
    desk.manager.tick()
    assert [r["reservation_id"] for r in desk.replies.values()] == ["res-b", "res-c"]
    desk.replies.clear()
    desk.reserve("d", ids(30, 300), max_new_tokens=2)
    desk.clock.now += LEASE_S + 1
    desk.manager.tick()  # b and c lapse (granted), d is refused (pending)
    assert list(desk.replies.values()) == [{"ok": False, "error": "no KV slots became free within the lease"}]
    stats = desk.manager.stats()
    assert stats["num_reservations_lapsed"] == 2 and stats["num_reservations_active"] == 0
    assert_no_leak(desk.sched)


def test_every_layer_must_arrive_once() -> None:
    desk = Desk()
    grant = desk.reserve("a", ids(6))
    assert grant is not None
    layers = desk.sched.runner.kv_pool.num_layers
    desk.manager.receive(KVChunkInMsg("res-a", desk.chunk(0, 1, 6)))
    missing = desk.done("res-a")
    assert not missing["ok"] and missing["error"] == f"KV of {layers - 1} layers did not arrive (first missing: 1)"
    desk.manager.receive(KVChunkInMsg("res-a", desk.chunk(0, 1, 6)))  # layer 0 again
    twice = desk.done("res-a")
    assert twice["error"] == "layers [0, 1) were received twice"
    desk.manager.cancel("res-a")
    assert_no_leak(desk.sched)


def test_chunks_for_a_gone_reservation_are_counted_and_dropped() -> None:
    desk = Desk()
    desk.manager.receive(KVChunkInMsg("res-nobody", desk.chunk(0, 1, 3)))
    assert desk.manager.stats()["num_stale_chunks"] == 1
    gone = desk.done("res-nobody")
    assert gone == {"ok": False, "error": "the reservation is gone (lapsed, cancelled or aborted)"}


def test_a_complete_transfer_commits_the_first_token_and_decodes_on() -> None:
    desk = Desk()
    prompt = ids(6)
    desk.reserve("a", prompt, max_new_tokens=3)
    layers = desk.sched.runner.kv_pool.num_layers
    desk.manager.receive(KVChunkInMsg("res-a", desk.chunk(0, layers, 6)))
    assert desk.done("res-a")["ok"]
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    desk.manager.resolve(ResolveReservationMsg("a", "res-a", prompt, params, first_token=42, cached_tokens=2))
    assert desk.manager.stats()["num_committed"] == 1 and desk.sched.running[0].rid == "a"
    run_until_idle(desk.sched)
    assert desk.out.tokens["a"][0] == 42 and len(desk.out.tokens["a"]) == 3 and desk.out.cached["a"] == 2
    assert_no_leak(desk.sched)


def test_without_its_kv_the_prompt_is_computed_here_and_the_reason_counted() -> None:
    desk = Desk()
    prompt = ids(6)
    desk.reserve("a", prompt, max_new_tokens=2)
    params = SamplingParams(max_new_tokens=2, temperature=0.0)
    desk.manager.resolve(ResolveReservationMsg("a", "res-a", prompt, params, first_token=42))
    desk.manager.resolve(ResolveReservationMsg("b", "res-b", ids(3, 50), params, first_token=-1,
                                               fallback_reason="prefill worker gone"))
    assert desk.manager.fallback_reasons == {"KV incomplete": 1, "prefill worker gone": 1}
    run_until_idle(desk.sched)
    assert len(desk.out.tokens["a"]) == 2 and len(desk.out.tokens["b"]) == 2
    assert_no_leak(desk.sched)


def test_abort_and_cancel_give_everything_back() -> None:
    desk = Desk(max_total_tokens=40)
    desk.reserve("a", ids(30), max_new_tokens=2)
    desk.reserve("b", ids(20, 100), max_new_tokens=2)  # pending
    desk.manager.abort("b")
    assert list(desk.replies.values()) == [{"ok": False, "error": "cancelled"}]
    desk.manager.cancel("res-a")
    stats = desk.manager.stats()
    assert stats["num_reservations_active"] == stats["num_reservations_pending"] == 0
    assert stats["num_reserved_tokens"] == 0
    assert_no_leak(desk.sched)


def test_granted_reservations_count_against_the_decode_reserve_of_the_scheduler() -> None:
    desk = Desk(max_total_tokens=64, init_new_token_ratio=1.0)
    first = desk.reserve("a", ids(20), max_new_tokens=20)
    assert first is not None and first["ok"]
    # a's 20 slots and its 20 expected new tokens leave 24: a prompt of 10 expecting 17 more does not fit
    assert desk.reserve("b", ids(10, 100), max_new_tokens=17) is None
    desk.manager.cancel("res-b")
    desk.manager.cancel("res-a")
    assert_no_leak(desk.sched)


def test_take_hands_a_grant_over_and_cancels_a_pending_one() -> None:
    desk = Desk(max_total_tokens=40)
    desk.reserve("a", ids(30), max_new_tokens=2)
    desk.reserve("b", ids(20, 100), max_new_tokens=2)
    taken = desk.manager.take("res-a")
    assert taken is not None and taken.req.rid == "a" and taken.slots.dtype == torch.int64
    assert desk.manager.take("res-b") is None and desk.replies  # the pending one was cancelled and told
    desk.manager.free(taken)
    desk.manager.receive(KVChunkInMsg("res-a", desk.chunk(0, 1, 3)))
    assert desk.manager.stats()["num_stale_chunks"] == 1
    desk.manager.cancel("res-unknown")  # nothing to cancel: no error
    assert_no_leak(desk.sched)
