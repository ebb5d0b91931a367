"""Prefill admission on its own (scheduler/prefill.py): the waiting queue, the chunked prompt, the token, row and
KV budgets, the prefix cache, and the hooks that leave requests out. KV memory without a model."""

from __future__ import annotations

import pytest

from radixmesh.engine.attention.base import ForwardMode
from radixmesh.engine.batch import commit_batch
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.hooks import SchedulerHook

from .manager_factory import make_parts, req, slots_accounted


def admit(parts: object, running: list[Req] | None = None, ratio: float = 1.0) -> list[Req]:
    batch = parts.prefill.schedule(running if running is not None else [], ratio)  # type: ignore[attr-defined]
    return [] if batch is None else list(batch.reqs)


def test_nothing_waiting_schedules_nothing() -> None:
    parts = make_parts()
    assert not parts.prefill.has_work
    assert parts.prefill.schedule([], 1.0) is None
    assert parts.counters.num_prompt_tokens == 0


def test_one_request_is_admitted_whole_and_counted_once() -> None:
    parts = make_parts()
    r = req("a", prompt_len=6)
    parts.prefill.enqueue(r)
    assert parts.prefill.has_work
    batch = parts.prefill.schedule([], 1.0)
    assert batch is not None and batch.mode is ForwardMode.EXTEND
    assert batch.reqs == [r] and batch.input_ids == r.origin_input_ids and batch.positions == list(range(6))
    assert batch.extend_lens == [6] and batch.prefix_lens == [0] and batch.out_cache_loc.numel() == 6
    assert not parts.prefill.waiting and parts.prefill.chunked_req is None and not parts.prefill.has_work
    assert r.admitted_at is not None and r.cached_tokens == 0 and r.req_pool_idx is not None
    assert (parts.counters.num_prompt_tokens, parts.counters.num_cached_tokens) == (6, 0)


def test_requests_join_one_pass_in_arrival_order_within_the_token_budget() -> None:
    parts = make_parts(schedule_policy="fcfs", chunked_prefill_size=-1, max_prefill_tokens=10)
    reqs = [req(f"r{i}", prompt_len=4, first_id=10 * i + 1) for i in range(4)]
    for r in reqs:
        parts.prefill.enqueue(r)
    first = admit(parts)
    # 4 + 4 fit the 10-token budget; the third would pass it
    assert [r.rid for r in first] == ["r0", "r1"]
    assert [r.rid for r in parts.prefill.waiting] == ["r2", "r3"]
    assert [r.rid for r in admit(parts, running=first)] == ["r2", "r3"]


def test_rows_limit_admission_to_what_may_run() -> None:
    parts = make_parts(max_running_requests=3, schedule_policy="fcfs")
    for i in range(5):
        parts.prefill.enqueue(req(f"r{i}", prompt_len=2, max_new_tokens=1, first_id=10 * i + 1))
    running = [req("old", prompt_len=1, first_id=90)]
    assert [r.rid for r in admit(parts, running=running)] == ["r0", "r1"]  # 3 rows, one of them running


def test_a_long_prompt_is_prefilled_in_chunks_under_the_budget() -> None:
    parts = make_parts(chunked_prefill_size=8, num_tokens=64)
    r = req("long", prompt_len=20, max_new_tokens=2)
    parts.prefill.enqueue(r)
    seen: list[tuple[int, int, bool]] = []
    while True:
        batch = parts.prefill.schedule([], 1.0)
        assert batch is not None and batch.reqs == [r]
        seen.append((batch.prefix_lens[0], batch.extend_lens[0], r.is_chunked))
        commit_batch(batch)
        if not r.is_chunked:
            break
        parts.kv.cache_unfinished(r)  # what the scheduler does when it launches a chunk
        parts.prefill.chunked_req = r
        assert parts.prefill.has_work and not parts.prefill.waiting
    assert seen == [(0, 8, True), (8, 8, True), (16, 4, False)]
    assert r.kv_len == 20 and parts.counters.num_prompt_tokens == 20  # counted at its first chunk only


def test_without_chunking_a_prompt_over_the_budget_waits_for_an_empty_pass() -> None:
    parts = make_parts(chunked_prefill_size=-1, max_prefill_tokens=8, schedule_policy="fcfs")
    small, big = req("small", prompt_len=4), req("big", prompt_len=12, first_id=40)
    parts.prefill.enqueue(small)
    parts.prefill.enqueue(big)
    assert [r.rid for r in admit(parts)] == ["small"]  # big does not join a pass that holds another prompt
    assert [r.rid for r in admit(parts)] == ["big"]  # alone, it may pass the budget


def test_the_decode_reserve_of_running_requests_holds_back_admission() -> None:
    parts = make_parts(num_tokens=40, schedule_policy="fcfs")
    running = [req("run", prompt_len=1, max_new_tokens=30, first_id=90)]
    parts.prefill.enqueue(req("a", prompt_len=12, max_new_tokens=4))
    assert admit(parts, running=running, ratio=1.0) == []  # 30 reserved: the prompt's 12 slots are not there
    assert [r.rid for r in admit(parts, running=running, ratio=0.5)] == ["a"]  # 15 reserved leaves room


def test_a_cached_prefix_is_reused_and_counted() -> None:
    parts = make_parts()
    first = req("first", prompt_len=10)
    parts.prefill.enqueue(first)
    batch = parts.prefill.schedule([], 1.0)
    assert batch is not None
    commit_batch(batch)
    parts.kv.release(first)  # done: its prompt's KV goes to the tree
    again = req("again", prompt_len=12)  # the same first 10 ids, then 2 more
    parts.prefill.enqueue(again)
    batch = parts.prefill.schedule([], 1.0)
    assert batch is not None and batch.prefix_lens == [10] and batch.extend_lens == [2]
    assert again.cached_tokens == 10
    assert (parts.counters.num_prompt_tokens, parts.counters.num_cached_tokens) == (22, 10)


def test_a_retracted_request_goes_first_and_is_not_counted_again() -> None:
    parts = make_parts(schedule_policy="fcfs")
    r, other = req("r", prompt_len=5), req("other", prompt_len=3, first_id=30)
    parts.prefill.enqueue(other)
    parts.prefill.enqueue(r)
    batch = parts.prefill.schedule([], 1.0)
    assert batch is not None and [x.rid for x in batch.reqs] == ["other", "r"]
    commit_batch(batch)
    prompt_tokens = parts.counters.num_prompt_tokens
    parts.kv.release(r)
    r.num_retractions += 1
    parts.prefill.enqueue(req("late", prompt_len=2, first_id=50))
    parts.prefill.requeue(r)
    assert [x.rid for x in parts.prefill.waiting] == ["r", "late"]
    batch = parts.prefill.schedule([other], 1.0)
    assert batch is not None and batch.reqs[0] is r
    assert parts.counters.num_prompt_tokens == prompt_tokens + 2  # only "late" counted


def test_abort_takes_waiting_and_chunked_requests() -> None:
    parts = make_parts(chunked_prefill_size=4)
    waiting, chunked = req("w"), req("c", prompt_len=10, first_id=20)
    parts.prefill.enqueue(chunked)
    batch = parts.prefill.schedule([], 1.0)
    assert batch is not None and chunked.is_chunked
    commit_batch(batch)
    parts.kv.cache_unfinished(chunked)
    parts.prefill.chunked_req = chunked
    parts.prefill.enqueue(waiting)
    assert parts.prefill.take_waiting("nobody") == [] and parts.prefill.take_chunked("w") == []
    assert parts.prefill.take_waiting("w") == [waiting] and not parts.prefill.waiting
    assert parts.prefill.take_chunked("c") == [chunked] and parts.prefill.chunked_req is None
    parts.kv.release(chunked)
    assert slots_accounted(parts.kv)


class HoldBack(SchedulerHook):
    """Leaves the requests it names out of admission (as the host tier does while their prefix loads)."""

    def __init__(self, *rids: str) -> None:
        self.rids = set(rids)
        self.calls: list[list[str]] = []

    def admissible(self, waiting: list[Req]) -> list[Req]:
        self.calls.append([r.rid for r in waiting])
        return [r for r in waiting if r.rid not in self.rids]


def test_hooks_leave_requests_out_of_admission_without_losing_them() -> None:
    hook = HoldBack("b")
    parts = make_parts(hooks=[hook], schedule_policy="fcfs")
    for rid, first in (("a", 1), ("b", 20), ("c", 40)):
        parts.prefill.enqueue(req(rid, prompt_len=3, first_id=first))
    assert [r.rid for r in admit(parts)] == ["a", "c"]
    assert hook.calls == [["a", "b", "c"]] and [r.rid for r in parts.prefill.waiting] == ["b"]
    hook.rids.clear()
    assert [r.rid for r in admit(parts)] == ["b"]


def test_hooks_filter_in_order() -> None:
    first, second = HoldBack("a"), HoldBack("b")
    parts = make_parts(hooks=[first, second], schedule_policy="fcfs")
    for rid, start in (("a", 1), ("b", 20), ("c", 40)):
        parts.prefill.enqueue(req(rid, prompt_len=3, first_id=start))
    assert [r.rid for r in admit(parts)] == ["c"]
    assert first.calls == [["a", "b", "c"]] and second.calls == [["b", "c"]]


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_prefix_aware_policies_admit_the_longest_cached_prefix_first(policy: str) -> None:
    parts = make_parts(schedule_policy=policy, max_prefill_tokens=6, chunked_prefill_size=-1)
    warm = req("warm", prompt_len=8, first_id=100)
    parts.prefill.enqueue(warm)
    batch = parts.prefill.schedule([], 1.0)
    assert batch is not None
    commit_batch(batch)
    parts.kv.release(warm)
    cold, hot = req("cold", prompt_len=5, first_id=1), req("hot", prompt_len=12, first_id=100)
    parts.prefill.enqueue(cold)
    parts.prefill.enqueue(hot)
    assert admit(parts)[0].rid == "hot"  # 8 cached: only 4 to compute


def test_fcfs_keeps_arrival_order_whatever_is_cached() -> None:
    parts = make_parts(schedule_policy="fcfs", max_prefill_tokens=6, chunked_prefill_size=-1)
    warm = req("warm", prompt_len=8, first_id=100)
    parts.prefill.enqueue(warm)
    batch = parts.prefill.schedule([], 1.0)
    assert batch is not None
    commit_batch(batch)
    parts.kv.release(warm)
    parts.prefill.enqueue(req("cold", prompt_len=5, first_id=1))
    parts.prefill.enqueue(req("hot", prompt_len=12, first_id=100))
    assert [r.rid for r in admit(parts)] == ["cold"]
