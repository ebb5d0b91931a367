"""Packing one prefill pass (scheduler/policy.py `PrefillAdder`): the token budget, the rows, the KV budget with the
decode reserve, chunking, and the chunked prompt continued first. KV memory without a model."""

from __future__ import annotations

from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.policy import PrefillAdder, WaitingOrder, order_waiting

from .manager_factory import make_config, make_kv, req


def matched(kv: object, *reqs: Req) -> list[Req]:
    for r in reqs:
        kv.match(r)  # type: ignore[attr-defined]
    return list(reqs)


def test_requests_are_taken_until_the_token_budget_is_spent() -> None:
    kv = make_kv(num_tokens=64)
    adder = PrefillAdder(make_config(chunked_prefill_size=-1, max_prefill_tokens=10), kv, [], 1.0)
    a, b, c = matched(kv, req("a", prompt_len=4, max_new_tokens=1), req("b", prompt_len=5, first_id=20,
                                                                          max_new_tokens=1),
                      req("c", prompt_len=3, first_id=40, max_new_tokens=1))
    assert adder.try_add(a) and adder.try_add(b)
    assert not adder.try_add(c)  # 1 token of budget left, and no chunking
    assert adder.can_run == [a, b] and adder.token_budget == 1 and c.last_node is None  # c left unlocked


def test_the_decode_reserve_counts_running_requests_and_those_admitted() -> None:
    kv = make_kv(num_tokens=40)
    running = [req("run", prompt_len=1, max_new_tokens=11)]
    adder = PrefillAdder(make_config(init_new_token_ratio=0.5), kv, running, 0.5)
    assert adder.reserved[0] == 6 and adder.kv_budget() == 34  # (one pool: rank 0)
    a = matched(kv, req("a", prompt_len=10, max_new_tokens=9))[0]
    assert adder.try_add(a) and adder.planned[0] == 10 + 5 and adder.kv_budget() == 19
    b = matched(kv, req("b", prompt_len=16, first_id=30, max_new_tokens=9))[0]
    assert not adder.try_add(b)  # 16 + 5 does not fit the 19 left once another request is in the pass


def test_alone_a_prompt_may_use_the_whole_budget_without_its_decode_reserve() -> None:
    kv = make_kv(num_tokens=20)
    adder = PrefillAdder(make_config(), kv, [], 1.0)
    big = matched(kv, req("big", prompt_len=18, max_new_tokens=30))[0]
    assert adder.try_add(big) and adder.can_run == [big]  # it decodes into what frees later (or retracts)


def test_rows_run_out() -> None:
    kv = make_kv(num_tokens=64)
    adder = PrefillAdder(make_config(max_running_requests=2), kv, [req("run", first_id=90)], 0.1)
    a, b = matched(kv, req("a", prompt_len=2, max_new_tokens=1), req("b", prompt_len=2, first_id=20,
                                                                      max_new_tokens=1))
    assert adder.try_add(a) and not adder.try_add(b) and adder.num_slots_left == 0


def test_a_long_prompt_is_cut_to_the_budget_and_ends_the_pass() -> None:
    kv = make_kv(num_tokens=64)
    adder = PrefillAdder(make_config(chunked_prefill_size=6), kv, [], 1.0)
    short, long, late = matched(kv, req("short", prompt_len=2, max_new_tokens=1),
                                req("long", prompt_len=20, first_id=20), req("late", prompt_len=1, first_id=60))
    assert adder.try_add(short)
    assert not adder.try_add(long)  # admitted as a chunk; nothing may follow it
    assert long.is_chunked and long.extend_len == 4 and adder.chunked is long and adder.can_run == [short, long]
    assert not adder.try_add(late)


def test_the_chunked_prompt_continues_first_and_waits_when_there_is_no_room() -> None:
    kv = make_kv(num_tokens=64)
    long = matched(kv, req("long", prompt_len=20))[0]
    first = PrefillAdder(make_config(chunked_prefill_size=8), kv, [], 1.0)
    first.try_add(long)
    long.kv_len = long.extend_len  # (its first chunk ran)
    adder = PrefillAdder(make_config(chunked_prefill_size=8), kv, [], 1.0)
    adder.add_chunked(long)
    assert long.extend_len == 8 and long.is_chunked and adder.chunked is long
    long.kv_len = 16
    last = PrefillAdder(make_config(chunked_prefill_size=8), kv, [], 1.0)
    last.add_chunked(long)
    assert long.extend_len == 4 and not long.is_chunked and last.chunked is None and last.can_run == [long]
    full = make_kv(num_tokens=8)
    taken = full.alloc_slots(8)
    assert taken is not None
    stuck = PrefillAdder(make_config(chunked_prefill_size=8), full, [], 1.0)
    stuck.add_chunked(long)
    assert long.extend_len == 0 and stuck.chunked is long and stuck.can_run == []  # decode frees room first


def test_add_waiting_matches_what_the_order_left_unmatched() -> None:
    kv = make_kv(num_tokens=64)
    reqs = [req(f"r{i}", prompt_len=3, first_id=10 * i + 1, max_new_tokens=1) for i in range(3)]
    adder = PrefillAdder(make_config(), kv, [], 1.0)
    adder.add_waiting(WaitingOrder(reqs, num_matched=0))
    assert adder.can_run == reqs and all(r.last_node is not None for r in reqs)


def test_order_waiting_leaves_fcfs_alone_and_windows_prefix_policies() -> None:
    kv = make_kv(num_tokens=64)
    reqs = [req(f"r{i}", prompt_len=3, first_id=10 * i + 1) for i in range(5)]
    fcfs = order_waiting(reqs, make_config(schedule_policy="fcfs"), kv)
    assert fcfs.reqs == reqs and fcfs.num_matched == 0 and fcfs.deferred == []
    lpm = order_waiting(reqs, make_config(schedule_policy="lpm", schedule_policy_window=2), kv)
    assert lpm.num_matched == 2 and set(map(id, lpm.reqs)) == set(map(id, reqs))
    assert reqs[2].matched_node is None  # beyond the window: matched only when admission reaches it
    no_cache = make_kv(num_tokens=64, disable_cache=True)
    assert order_waiting(reqs, make_config(schedule_policy="lpm"), no_cache).num_matched == 0
