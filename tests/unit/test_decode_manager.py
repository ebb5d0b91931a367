"""Decode on its own (scheduler/decode.py): the running set, its decode batches, the new-token ratio, and retraction
when KV runs out. KV memory without a model; requests get their KV through the prefill manager."""

from __future__ import annotations

import math

import pytest

from radixmesh.engine.attention.base import ForwardMode
from radixmesh.engine.batch import ScheduleBatch, build_decode_batch, commit_batch
from radixmesh.engine.request import FinishReason, Req
from radixmesh.engine.scheduler.hooks import SchedulerHook

from .manager_factory import CONTEXT_LEN, Parts, make_parts, req, slots_accounted


def prefilled(parts: Parts, *reqs: Req) -> list[Req]:
    """Admit and "run" the prompts of `reqs`: their KV is in their rows, each has sampled one token."""
    for r in reqs:
        parts.prefill.enqueue(r)
    batch = parts.prefill.schedule(parts.decode.running, parts.decode.new_token_ratio)
    assert batch is not None and batch.reqs == list(reqs), "the prompts did not fit one pass"
    commit_batch(batch)
    for r in reqs:
        r.output_ids.append(7)
        parts.decode.running.append(r)
    return list(reqs)


def test_nothing_running_schedules_nothing_and_keeps_the_ratio() -> None:
    parts = make_parts()
    assert parts.decode.schedule() is None
    assert parts.decode.new_token_ratio == parts.config.init_new_token_ratio


def test_a_decode_batch_feeds_each_request_its_last_token() -> None:
    parts = make_parts()
    a, b = prefilled(parts, req("a", prompt_len=3), req("b", prompt_len=5, first_id=20))
    b.output_ids.append(9)
    batch = parts.decode.schedule()
    assert batch is not None and batch.mode is ForwardMode.DECODE and batch.reqs == [a, b]
    assert batch.input_ids == [7, 9] and batch.positions == [3, 5] and batch.out_cache_loc.numel() == 2
    assert batch.future_rows is None


def test_the_ratio_decays_each_decode_step_down_to_its_floor() -> None:
    parts = make_parts(init_new_token_ratio=0.5, min_new_token_ratio=0.2, new_token_ratio_decay_steps=3)
    prefilled(parts, req("a", max_new_tokens=50))
    seen = []
    for _ in range(5):
        batch = parts.decode.schedule()
        assert batch is not None
        commit_batch(batch)
        batch.reqs[0].output_ids.append(7)
        seen.append(round(parts.decode.new_token_ratio, 6))
    assert seen == [0.4, 0.3, 0.2, 0.2, 0.2]
    parts.decode.reset_ratio()
    assert parts.decode.new_token_ratio == 0.5


def test_need_and_reserve_follow_the_ratio() -> None:
    parts = make_parts(init_new_token_ratio=0.5)
    a, b = prefilled(parts, req("a", max_new_tokens=9), req("b", max_new_tokens=4, first_id=30))
    assert (a.remaining_new_tokens, b.remaining_new_tokens) == (8, 3)
    assert parts.decode.need(a) == 4 and parts.decode.need(b) == math.ceil(1.5)
    assert parts.decode.reserved_tokens() == 6


def test_a_request_whose_last_token_is_in_flight_sits_the_step_out() -> None:
    parts = make_parts(init_new_token_ratio=0.5)
    done, going = prefilled(parts, req("done", max_new_tokens=2), req("going", max_new_tokens=5, first_id=30))
    done.futures.append((1, 0))  # its second (last) token is on the device
    batch = parts.decode.schedule()
    assert batch is not None and batch.reqs == [going]
    going.futures.append((1, 1))
    going.output_ids += [8, 8, 8]  # with the in-flight one, its fifth: the last
    ratio = parts.decode.new_token_ratio
    assert parts.decode.schedule() is None
    assert parts.decode.new_token_ratio == ratio  # no decode step, no decay


def test_a_request_at_the_context_end_is_left_out() -> None:
    parts = make_parts()
    (full,) = prefilled(parts, req("full", prompt_len=CONTEXT_LEN - 2, max_new_tokens=8))
    assert parts.decode.schedule() is not None  # prompt + 1 output < context
    full.output_ids.append(8)
    assert parts.decode.schedule() is None  # prompt + 2 outputs reach it


def test_retraction_frees_the_least_progressed_request_and_raises_the_ratio() -> None:
    parts = make_parts(num_tokens=16, init_new_token_ratio=0.1, min_new_token_ratio=0.05,
                       new_token_ratio_decay_steps=100, schedule_policy="fcfs")
    a, b, c = prefilled(parts, req("a", prompt_len=4), req("b", prompt_len=3, first_id=20),
                        req("c", prompt_len=5, first_id=40))
    a.output_ids.append(8)  # a has two tokens, b and c one each: c (the longer prompt) has the least done
    filler = parts.kv.alloc_slots(parts.kv.allocator.available_size())  # nothing left for three new tokens
    assert filler is not None and parts.kv.available_tokens() == 0
    c.futures.append((4, 2))
    requeued: list[Req] = []
    parts.decode.requeue = requeued.append
    parts.decode.new_token_ratio = 0.6
    batch = parts.decode.schedule()
    assert requeued == [c] and parts.decode.running == [a, b]
    assert c.futures == [] and c.req_pool_idx is None and c.num_retractions == 1
    assert parts.counters.num_retractions == 1
    assert batch is not None and batch.reqs == [a, b]  # two slots: evicted from c's cached prompt
    assert parts.decode.new_token_ratio == pytest.approx(min(1.0, max(0.1, 1.5 * 0.6)) - parts.decode.ratio_decay)
    parts.kv.allocator.free(filler)


def test_the_last_request_stops_with_length_when_even_it_cannot_grow() -> None:
    parts = make_parts(num_tokens=8)
    (only,) = prefilled(parts, req("only", prompt_len=6, max_new_tokens=20))
    filler = parts.kv.alloc_slots(parts.kv.allocator.available_size())
    assert filler is not None
    assert parts.decode.schedule() is None
    assert only.finish_reason is FinishReason.LENGTH and not parts.decode.running
    assert [o.finish_reason for o in parts.emitted.of("only")] == ["length"]
    assert parts.counters.num_retractions == 0
    parts.kv.allocator.free(filler)
    assert slots_accounted(parts.kv)


def test_abort_takes_running_requests() -> None:
    parts = make_parts()
    a, b = prefilled(parts, req("a"), req("b", first_id=30))
    assert parts.decode.take("nobody") == []
    assert parts.decode.take("a") == [a] and parts.decode.running == [b]


class Drafts(SchedulerHook):
    """Builds decode batches itself for the requests it names (as speculative decoding does)."""

    def __init__(self, parts: Parts, *rids: str) -> None:
        self.parts = parts
        self.rids = set(rids)
        self.asked: list[list[str]] = []

    def decode_batch(self, reqs: list[Req]) -> ScheduleBatch | None:
        self.asked.append([r.rid for r in reqs])
        if not self.rids & {r.rid for r in reqs}:
            return None
        return build_decode_batch(reqs, self.parts.kv)


def test_a_hook_may_build_the_decode_batch() -> None:
    parts = make_parts()
    hook = Drafts(parts, "b")
    parts.hooks.add(hook)
    a, b = prefilled(parts, req("a"), req("b", first_id=30))
    batch = parts.decode.schedule()
    assert batch is not None and batch.reqs == [a, b] and hook.asked == [["a", "b"]]
    hook.rids.clear()
    assert parts.decode.schedule() is not None and len(hook.asked) == 2  # None: the plain batch
