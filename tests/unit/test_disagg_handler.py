"""Disaggregation as a scheduler feature (engine/disagg/handler.py): constructing the handler plugs it into the
scheduler (first hook, output filter), its messages reach their part, and a step ticks its leases; prefix
sharing's fetched KV goes into the radix cache (engine/disagg/fetch.py)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from radixmesh.engine.disagg.handler import DisaggHandler
from radixmesh.engine.grammar.hook import GrammarHook
from radixmesh.wire.disagg import (
    CancelReservationMsg,
    CommitFetchMsg,
    PrefixLenReqMsg,
    ReserveReqMsg,
    TrimReservationMsg,
)
from radixmesh.wire.sampling import SamplingParams

from .router_factory import FakeClock
from .scheduler_factory import assert_no_leak, make_scheduler, run_until_idle

PARAMS = SamplingParams(max_new_tokens=3, temperature=0.0)


def handler_of(**overrides: Any) -> tuple[DisaggHandler, Any, dict[str, dict[str, Any]], list[Any], FakeClock]:
    sched, out = make_scheduler(**overrides)
    replies: dict[str, dict[str, Any]] = {}
    sent: list[Any] = []
    handler = DisaggHandler(sched, sent.append, replies.__setitem__)
    clock = FakeClock()
    handler.reservations.clock = handler.exports.clock = clock
    return handler, out, replies, sent, clock


def reserve(handler: DisaggHandler, replies: dict[str, dict[str, Any]], rid: str, ids: list[int],
            lease_s: float = 5.0) -> dict[str, Any] | None:
    query = uuid.uuid4().hex
    handler.handle(ReserveReqMsg(query, f"res-{rid}", rid, ids, PARAMS, lease_s))
    return replies.pop(query, None)


def test_constructing_the_handler_plugs_it_in_first() -> None:
    handler, _, _, _, _ = handler_of()
    sched = handler.sched
    assert next(iter(sched.hooks)) is handler and sched.hooks.get(GrammarHook) is not None
    assert sched.emit == handler.emit_outputs
    stats = sched.stats()
    assert "num_reservations_active" in stats and stats["disagg_fallback_reasons"] == {}


def test_a_step_ticks_the_leases() -> None:
    handler, _, replies, _, clock = handler_of()
    grant = reserve(handler, replies, "a", list(range(1, 9)))
    assert grant is not None and grant["ok"]
    clock.now += 10
    handler.sched.step()  # nothing to run, but the step starts with the handler's tick
    assert handler.stats()["num_reservations_lapsed"] == 1
    assert_no_leak(handler.sched)


def test_an_abort_reaches_the_handler_through_the_scheduler() -> None:
    handler, _, replies, _, _ = handler_of()
    reserve(handler, replies, "a", list(range(1, 9)))
    handler.sched.abort("a")
    assert handler.stats()["num_reservations_active"] == 0
    assert_no_leak(handler.sched)


def test_each_message_reaches_its_part() -> None:
    handler, _, replies, _, _ = handler_of()
    reserve(handler, replies, "a", list(range(1, 9)))
    handler.handle(CancelReservationMsg("res-a"))
    assert handler.stats()["num_reservations_active"] == 0
    handler.handle(PrefixLenReqMsg("q", list(range(1, 5))))
    assert replies.pop("q") == {"device_len": 0, "host_len": 0}
    with pytest.raises(AssertionError, match="not a disaggregation message"):
        handler.handle(object())


def test_a_fetched_prefix_is_trimmed_committed_and_counted_as_cached() -> None:
    handler, out, replies, _, _ = handler_of()
    ids = list(range(1, 21))
    grant = reserve(handler, replies, "f", ids[:12])
    assert grant is not None and grant["num_reserved_tokens"] == 12
    handler.handle(TrimReservationMsg("res-f", 8))  # the peer holds only 8 of them
    assert handler.reservations.active["res-f"].slots.numel() == 8
    layers = handler.sched.runner.kv_pool.num_layers
    reservation = handler.reservations.active["res-f"]
    reservation.layers_received = [True] * layers  # (the chunks' content is the transport's business)
    handler.handle(CommitFetchMsg("f", "res-f", ids, PARAMS, ""))
    run_until_idle(handler.sched)
    assert handler.stats()["num_peer_fetch_commits"] == 1 and handler.stats()["peer_fetched_tokens"] == 8
    assert out.cached["f"] == 8 and len(out.tokens["f"]) == 3
    assert_no_leak(handler.sched)


def test_a_fetch_that_failed_computes_the_prompt_and_names_why() -> None:
    handler, out, replies, _, _ = handler_of()
    ids = list(range(1, 11))
    reserve(handler, replies, "f", ids[:6])
    handler.handle(CommitFetchMsg("f", "res-f", ids, PARAMS, "peer unavailable"))
    handler.handle(CommitFetchMsg("g", "res-gone", ids, PARAMS, ""))
    run_until_idle(handler.sched)
    assert handler.stats()["peer_fetch_fallback_reasons"] == {"peer unavailable": 1, "lease lapsed": 1}
    assert out.cached["f"] == 0 and len(out.tokens["f"]) == len(out.tokens["g"]) == 3
    assert_no_leak(handler.sched)


def test_a_trim_after_kv_arrived_or_for_a_gone_reservation_does_nothing() -> None:
    handler, _, replies, _, _ = handler_of()
    reserve(handler, replies, "f", list(range(1, 11)))
    handler.reservations.active["res-f"].layers_received[0] = True
    handler.handle(TrimReservationMsg("res-f", 2))
    handler.handle(TrimReservationMsg("res-nobody", 2))
    assert handler.reservations.active["res-f"].slots.numel() == 10
    handler.handle(CancelReservationMsg("res-f"))
    assert_no_leak(handler.sched)
