"""Result processing on its own (scheduler/results.py): sampled tokens appended to their requests, the stop rules
and the hooks' verdicts, finished requests released, outputs emitted. Results stand in for the device's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from radixmesh.engine.batch import LaunchedBatch, PromptLogprobPlan
from radixmesh.engine.request import FinishReason, Req
from radixmesh.engine.sampling.sampler import HostSample
from radixmesh.engine.scheduler.hooks import SchedulerHook, Verdict

from .manager_factory import FixedSample, Parts, launch, make_parts, req, slots_accounted


def admitted(parts: Parts, *reqs: Req, launch_id: int = 1, tokens: list[int] | None = None,
             **host: Any) -> LaunchedBatch:
    """The prefill pass of `reqs`, launched (committed, running), its first tokens `tokens`."""
    for r in reqs:
        parts.prefill.enqueue(r)
    batch = parts.prefill.schedule(parts.decode.running, parts.decode.new_token_ratio)
    assert batch is not None and batch.reqs == list(reqs)
    return launch(batch, launch_id, tokens if tokens is not None else [5] * len(reqs), parts.decode.running, **host)


def decoded(parts: Parts, launch_id: int, tokens: list[int], **host: Any) -> LaunchedBatch:
    batch = parts.decode.schedule()
    assert batch is not None
    return launch(batch, launch_id, tokens, **host)


def test_tokens_reach_their_requests_and_go_out_once() -> None:
    parts = make_parts()
    a, b = req("a"), req("b", first_id=20)
    parts.results.process(admitted(parts, a, b, tokens=[11, 12]))
    assert (a.output_ids, b.output_ids) == ([11], [12]) and not a.futures and not b.futures
    assert [(o.rid, o.token_ids) for o in parts.emitted.outputs] == [("a", [11]), ("b", [12])]
    assert a.pending_ids == [] and parts.counters.num_generated_tokens == 2
    parts.results.process(decoded(parts, 2, [21, 22]))
    assert (a.output_ids, b.output_ids) == ([11, 21], [12, 22])
    assert parts.emitted.tokens("a") == [11, 21] and parts.emitted.tokens("b") == [12, 22]


def test_an_output_carries_the_request_counts() -> None:
    parts = make_parts()
    r = req("r", prompt_len=6)
    parts.results.process(admitted(parts, r))
    (out,) = parts.emitted.outputs
    assert (out.prompt_tokens, out.cached_tokens, out.completion_tokens) == (6, 0, 1)
    assert out.finish_reason is None and out.error is None and out.admitted_at == r.admitted_at
    assert out.logprobs is None and out.top_logprobs is None and out.input_logprobs is None


def test_rows_that_moved_on_since_launch_are_skipped() -> None:
    parts = make_parts()
    a, b = req("a"), req("b", first_id=20)
    launched = admitted(parts, a, b)
    b.futures.clear()  # retracted or aborted while its pass ran
    parts.results.process(launched)
    assert a.output_ids == [5] and b.output_ids == [] and [o.rid for o in parts.emitted.outputs] == ["a"]


def test_eos_finishes_releases_and_leaves_the_running_set() -> None:
    parts = make_parts(eos_ids={2})
    a, b = req("a"), req("b", first_id=20)
    parts.results.process(admitted(parts, a, b, tokens=[2, 9]))
    assert a.finish_reason is FinishReason.STOP and a.matched_stop == 2 and a.req_pool_idx is None
    assert parts.decode.running == [b] and b.finish_reason is None
    assert parts.emitted.of("a")[-1].finish_reason == "stop"


def test_ignore_eos_and_max_new_tokens() -> None:
    parts = make_parts(eos_ids={2})
    r = req("r", max_new_tokens=2, ignore_eos=True)
    parts.results.process(admitted(parts, r, tokens=[2]))
    assert r.finish_reason is None
    parts.results.process(decoded(parts, 2, [2]))
    assert r.finish_reason is FinishReason.LENGTH and parts.emitted.of("r")[-1].finish_reason == "length"
    assert not parts.decode.running and slots_accounted(parts.kv)


def test_logprobs_are_kept_only_when_asked_and_top_ones_cut_to_the_ask() -> None:
    parts = make_parts()
    plain, asks = req("plain"), req("asks", first_id=20, logprobs=True, top_logprobs=1)
    tops = [[(3, -0.1), (4, -2.0)], [(5, -0.2), (6, -1.5)]]
    parts.results.process(admitted(parts, plain, asks, tokens=[3, 5], logprobs=[-0.1, -0.2], top_logprobs=tops))
    out_plain, out_asks = parts.emitted.outputs
    assert out_plain.logprobs is None and out_plain.top_logprobs is None
    assert out_asks.logprobs == [-0.2] and out_asks.top_logprobs == [[(5, -0.2)]]


def test_prompt_logprobs_are_shared_out_by_the_plan() -> None:
    parts = make_parts()
    a, b = req("a", prompt_len=3), req("b", prompt_len=4, first_id=20)
    launched = admitted(parts, a, b, prompt_logprobs=[-1.0, -2.0, -3.0, -4.0, -5.0])
    launched.batch.prompt_logprobs = PromptLogprobPlan(rows=[0, 1, 3, 4, 5], targets=[0] * 5, counts=[2, 3],
                                                       next_pos=[3, 4])
    parts.results.process(launched)
    out_a, out_b = parts.emitted.outputs
    assert out_a.input_logprobs == [-1.0, -2.0] and out_b.input_logprobs == [-3.0, -4.0, -5.0]
    assert out_a.input_top_logprobs is None  # none asked


class Recorder(SchedulerHook):
    """Records the result-side calls; finishes a request on the token it names."""

    def __init__(self, log: list[str], stop_on: int | None = None) -> None:
        self.log = log
        self.stop_on = stop_on

    def on_results(self, batch: Any) -> None:
        self.log.append(f"results {[r.rid for r in batch.reqs]}")

    def token_verdict(self, r: Req, token_id: int) -> Verdict | None:
        self.log.append(f"verdict {r.rid} {token_id}")
        return (FinishReason.STOP, token_id) if token_id == self.stop_on else None

    def settle(self, r: Req, host: HostSample, row: int) -> None:
        self.log.append(f"settle {r.rid} {row} finished={r.finished}")

    def after_tokens(self, r: Req) -> None:
        self.log.append(f"after {r.rid} pool={r.req_pool_idx is not None}")


def test_hooks_see_each_result_in_order_before_release() -> None:
    log: list[str] = []
    parts = make_parts(hooks=[Recorder(log, stop_on=6)])
    a, b = req("a"), req("b", first_id=20)
    parts.results.process(admitted(parts, a, b, tokens=[6, 7]))
    assert log == ["results ['a', 'b']", "verdict a 6", "settle a 0 finished=True", "after a pool=True",
                   "verdict b 7", "settle b 1 finished=False", "after b pool=True"]
    assert a.finish_reason is FinishReason.STOP and a.matched_stop == 6 and a.req_pool_idx is None


def test_the_stop_rules_come_before_the_hooks_and_the_first_verdict_wins() -> None:
    log: list[str] = []
    first, second = Recorder(log, stop_on=7), Recorder(log, stop_on=7)
    parts = make_parts(hooks=[first, second], eos_ids={2})
    a, b = req("a"), req("b", first_id=20)
    parts.results.process(admitted(parts, a, b, tokens=[2, 7]))
    verdicts = [line for line in log if line.startswith("verdict")]
    assert verdicts == ["verdict b 7"]  # a stopped at EOS: no hook asked; b: the second hook not asked


@dataclass
class DraftRows(HostSample):
    """Verification results: row 0 appends three tokens, row 1 one."""

    def token_rows(self, row: int) -> range:
        return range(0, 3) if row == 0 else range(3, 4)


def test_a_row_may_append_several_tokens_and_stops_at_the_first_finishing_one() -> None:
    parts = make_parts(eos_ids={2})
    a, b = req("a"), req("b", first_id=20)
    launched = admitted(parts, a, b)
    launched.sampled = FixedSample(DraftRows([4, 2, 9, 8]))  # type: ignore[assignment]
    parts.results.process(launched)
    assert a.output_ids == [4, 2] and a.finish_reason is FinishReason.STOP  # 9 is past the EOS
    assert b.output_ids == [8] and parts.counters.num_generated_tokens == 3


def test_waiting_for_results_is_timed() -> None:
    parts = make_parts()
    launched = admitted(parts, req("a"))
    parts.results.process(launched)
    assert launched.sampled.reads == 1  # type: ignore[attr-defined]
    assert parts.counters.result_wait_s >= 0.0


def test_replacing_the_last_token_jumps_forward() -> None:
    parts = make_parts()
    r = req("r", max_new_tokens=10)
    parts.results.process(admitted(parts, r, tokens=[5]))
    r.pending_ids = [5]  # not sent yet (as while a jump is decided in the same step)
    parts.results.replace_last_token(r, [50, 51, 52])
    assert r.output_ids == [50, 51, 52] and r.pending_ids == [50, 51, 52]
    assert parts.counters.num_generated_tokens == 3 and r.finish_reason is None
    with pytest.raises(AssertionError, match="already sent"):
        r.pending_ids = []
        parts.results.replace_last_token(r, [60, 61])


def test_a_prefilled_request_starts_decoding_from_its_first_token() -> None:
    parts = make_parts(eos_ids={2})
    going, ending = req("going", prompt_len=5, logprobs=True, top_logprobs=1), req("ending", first_id=30)
    for r in (going, ending):
        assert parts.kv.assign_row(r)
        slots = parts.kv.alloc_slots(len(r.origin_input_ids))
        assert slots is not None and r.req_pool_idx is not None
        parts.kv.req_pool.write(r.req_pool_idx, 0, slots)
    going.cached_tokens = 2
    parts.results.start_decoding(going, 9, -0.5, [(9, -0.5)])
    parts.results.start_decoding(ending, 2, None, None)
    assert going.kv_len == 5 and going.output_ids == [9] and parts.decode.running == [going]
    assert ending.finish_reason is FinishReason.STOP and ending.req_pool_idx is None
    out_going, out_ending = parts.emitted.outputs
    assert out_going.logprobs == [-0.5] and out_going.top_logprobs == [[(9, -0.5)]] and out_going.cached_tokens == 2
    assert out_ending.finish_reason == "stop"
    assert (parts.counters.num_prompt_tokens, parts.counters.num_cached_tokens,
            parts.counters.num_generated_tokens) == (9, 2, 2)


def test_finish_releases_and_fail_needs_no_kv() -> None:
    parts = make_parts()
    r = req("r")
    launched = admitted(parts, r)
    parts.decode.running.remove(r)
    parts.results.finish(r, FinishReason.ABORT)
    assert r.req_pool_idx is None and not r.futures and parts.emitted.outputs[-1].finish_reason == "abort"
    parts.results.process(launched)  # its pass's results come back after the abort: nothing is appended
    assert r.output_ids == [] and len(parts.emitted.outputs) == 1
    bad = req("bad")
    parts.results.fail(bad, "the prompt is empty")
    last = parts.emitted.outputs[-1]
    assert (last.finish_reason, last.error) == ("error", "the prompt is empty")
    assert slots_accounted(parts.kv)


def test_a_chunk_in_a_batch_gets_no_token() -> None:
    parts = make_parts(chunked_prefill_size=4, schedule_policy="fcfs")
    long, short = req("long", prompt_len=10), req("short", prompt_len=2, first_id=30)
    parts.prefill.enqueue(short)
    parts.prefill.enqueue(long)
    batch = parts.prefill.schedule([], 1.0)
    assert batch is not None and long.is_chunked
    launched = launch(batch, 1, [5, 6], parts.decode.running)
    parts.results.process(launched)
    assert long.output_ids == [] and short.output_ids == [5] and long.kv_len == 2  # a chunk of 2 ran
