"""The prefill side's exports on their own (engine/disagg/exports.py), over a real tiny scheduler reached through
its public API: a prompt computed as a one-token request, its KV sent just before its first token, leases,
failures that turn the output into an error, and exports of cached KV."""

from __future__ import annotations

from typing import Any

from radixmesh.engine.disagg.exports import ExportManager
from radixmesh.engine.disagg.transport.registry import create_transport
from radixmesh.wire.disagg import ExportCachedReqMsg, KVExportMsg, PrefillReqMsg
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.sampling import SamplingParams

from .router_factory import FakeClock
from .scheduler_factory import assert_no_leak, make_scheduler, run_until_idle

LEASE_S = 5.0


class Desk:
    """A prefill scheduler whose outputs pass through its exports, as the disaggregation handler wires them."""

    def __init__(self, **overrides: Any) -> None:
        self.sched, self.out = make_scheduler(**overrides)
        self.events: list[tuple[str, Any]] = []
        self.clock = FakeClock()
        self.transports: dict[str, Any] = {}
        self.exports = ExportManager(self.sched, self.transport, self.sent, self.clock)
        collect = self.sched.emit

        def emit(outputs: list[TokenOut]) -> None:
            outputs = self.exports.on_outputs(outputs)
            self.events += [("out", o.rid) for o in outputs]
            collect(outputs)

        self.sched.emit = emit

    def transport(self, transport_id: str) -> Any:
        if transport_id not in self.transports:
            self.transports[transport_id] = create_transport(transport_id, self.sched.runner.kv_transfer_pool)
        return self.transports[transport_id]

    def sent(self, msg: KVExportMsg) -> None:
        self.events.append(("kv", msg.rid))

    def prefill(self, rid: str, ids: list[int], start_pos: int = 0, transport: str = "grpc") -> None:
        params = SamplingParams(max_new_tokens=7, temperature=0.0, n=1)
        self.exports.prefill(PrefillReqMsg(rid, f"tx-{rid}", ids, params, start_pos, transport, LEASE_S))


def prompt(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def test_a_prompt_runs_as_one_token_and_its_kv_leaves_before_that_token() -> None:
    desk = Desk()
    desk.prefill("a", prompt(12), start_pos=4)
    run_until_idle(desk.sched)
    assert len(desk.out.tokens["a"]) == 1 and desk.out.finish["a"] in ("length", "stop")
    assert desk.events[-1] == ("out", "a") and ("kv", "a") in desk.events
    assert desk.events.index(("kv", "a")) < desk.events.index(("out", "a"))
    stats = desk.exports.stats()
    assert stats["num_exports"] == 1 and stats["num_transfers_held"] == 1 and stats["kv_bytes_exported"] > 0
    assert desk.sched.kv.tree.protected_size() == 12  # locked until released
    desk.exports.release("tx-a")
    assert desk.exports.stats()["num_transfers_held"] == 0
    assert_no_leak(desk.sched)


def test_a_lease_that_runs_out_releases_the_kv() -> None:
    desk = Desk()
    desk.prefill("a", prompt(8))
    run_until_idle(desk.sched)
    desk.clock.now += LEASE_S + 1
    desk.exports.tick()
    assert desk.exports.stats()["num_transfers_lapsed"] == 1
    assert_no_leak(desk.sched)


def test_a_bad_start_or_transport_fails_the_request_without_running_it() -> None:
    desk = Desk()
    desk.prefill("far", prompt(5), start_pos=5)
    desk.prefill("odd", prompt(5), transport="pigeon")
    assert "start_pos 5 is outside the prompt of 5 tokens" in desk.out.errors["far"]
    assert "unknown KV transport 'pigeon'" in desk.out.errors["odd"]
    assert not desk.sched.has_work and desk.exports.stats()["num_prefills_running"] == 0


def test_without_the_radix_cache_the_export_fails_and_says_why() -> None:
    desk = Desk(disable_radix_cache=True)
    desk.prefill("a", prompt(6))
    run_until_idle(desk.sched)
    assert desk.out.finish["a"] == "error" and "needs its radix cache on" in desk.out.errors["a"]
    assert desk.exports.stats()["num_export_errors"] == 1 and ("kv", "a") not in desk.events
    assert_no_leak(desk.sched)


def test_an_aborted_prefill_exports_nothing() -> None:
    desk = Desk()
    desk.prefill("a", prompt(6))
    desk.sched.abort("a")
    desk.exports.abort("a")
    run_until_idle(desk.sched)
    assert desk.out.finish["a"] == "abort" and ("kv", "a") not in desk.events
    assert desk.exports.stats()["num_prefills_running"] == 0
    assert_no_leak(desk.sched)


def test_cached_kv_is_exported_without_computing_anything() -> None:
    desk = Desk()
    desk.prefill("warm", prompt(10))
    run_until_idle(desk.sched)
    desk.exports.release("tx-warm")
    passes = desk.sched.counters.num_forward_passes
    desk.exports.export_cached(ExportCachedReqMsg("c", "tx-c", prompt(14), 2, "grpc", LEASE_S))
    assert desk.sched.counters.num_forward_passes == passes
    assert desk.events[-2:] == [("kv", "c"), ("out", "c")] and desk.out.cached["c"] == 10
    stats = desk.exports.stats()
    assert stats["num_cached_exports"] == 1 and stats["cached_tokens_exported"] == 8
    desk.exports.release("tx-c")
    assert_no_leak(desk.sched)


def test_nothing_cached_past_the_start_sends_nothing_but_answers() -> None:
    desk = Desk()
    desk.exports.export_cached(ExportCachedReqMsg("c", "tx-c", prompt(6), 0, "grpc", LEASE_S))
    assert desk.events == [("out", "c")] and desk.out.cached["c"] == 0 and desk.out.finish["c"] == "length"
    assert desk.exports.stats()["num_cached_exports"] == 0


def test_outputs_of_other_requests_pass_through_unchanged() -> None:
    desk = Desk()
    plain = TokenOut("other", [1], 3, 0, 1, finish_reason="length")
    assert desk.exports.on_outputs([plain]) == [plain]
