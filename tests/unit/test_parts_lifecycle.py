"""The three scheduler parts driven together as `Scheduler.step` drives them, without a model: requests go from the
queue through prefill and decode to their end; what they output depends only on their position, so every
schedule (overlap or not, chunked, retracted, cached) must give the same tokens and leave no slot behind."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.batch import LaunchedBatch, ScheduleBatch, commit_batch
from radixmesh.engine.request import FinishReason, Req
from radixmesh.engine.sampling.sampler import HostSample

from .manager_factory import FixedSample, Parts, make_parts, req, slots_accounted


def token_at(first_id: int, position: int) -> int:
    """The "model": the token sampled at `position` of a sequence whose prompt starts with `first_id`."""
    return 1000 + (first_id * 13 + position) % 97


def expected(r: Req) -> list[int]:
    start = len(r.origin_input_ids)
    return [token_at(r.origin_input_ids[0], q) for q in range(start, start + r.params.max_new_tokens)]


class Driver:
    """What `Scheduler.step` does with its parts: schedule (prefill first), launch, process the batch before."""

    def __init__(self, parts: Parts, overlap: bool) -> None:
        self.parts = parts
        self.overlap = overlap
        self.in_flight: LaunchedBatch | None = None
        self.launch_id = 0
        self.batches: list[ScheduleBatch] = []

    def step(self) -> bool:
        p = self.parts
        batch = p.prefill.schedule(p.decode.running, p.decode.new_token_ratio)
        if batch is None and p.decode.running:
            batch = p.decode.schedule()
        launched = self.launch(batch) if batch is not None else None
        before, self.in_flight = self.in_flight, launched
        if before is not None:
            p.results.process(before)
        if not self.overlap and self.in_flight is not None:
            p.results.process(self.in_flight)
            self.in_flight = None
        return batch is not None or before is not None

    def launch(self, batch: ScheduleBatch) -> LaunchedBatch:
        """`Scheduler.launch` and its commit, with tokens from `token_at` instead of a forward pass."""
        p = self.parts
        self.launch_id += 1
        p.counters.num_forward_passes += 1
        self.batches.append(batch)
        if batch.is_decode:  # the runner writes a decode step's slots into the rows (on the device)
            rows, positions = torch.tensor(batch.req_pool_indices), torch.tensor(batch.positions)
            p.kv.req_pool.req_to_token[rows, positions] = batch.out_cache_loc
        commit_batch(batch)
        tokens = []
        for row, r in enumerate(batch.reqs):
            if r.is_chunked:
                p.kv.cache_unfinished(r)
                p.prefill.chunked_req = r
                tokens.append(0)  # a chunk samples nothing
                continue
            tokens.append(token_at(r.origin_input_ids[0], len(r.origin_input_ids) + r.num_output_tokens))
            r.futures.append((self.launch_id, row))
            if not batch.is_decode:
                p.kv.cache_unfinished(r)
                p.decode.running.append(r)
        return LaunchedBatch(self.launch_id, batch, FixedSample(HostSample(tokens)))

    def run(self, *reqs: Req, max_steps: int = 500) -> None:
        for r in reqs:
            self.parts.prefill.enqueue(r)
        for _ in range(max_steps):
            if not self.step() and not self.parts.prefill.has_work and not self.parts.decode.running:
                return
        pytest.fail("the parts did not drain")


def batch_of(n: int, prompt_len: int = 4, max_new_tokens: int = 6) -> list[Req]:
    return [req(f"r{i}", prompt_len=prompt_len, max_new_tokens=max_new_tokens, first_id=1 + 10 * i) for i in range(n)]


@pytest.mark.parametrize("overlap", [False, True])
def test_every_request_outputs_its_tokens_once_and_frees_its_rows(overlap: bool) -> None:
    parts = make_parts(schedule_policy="fcfs")
    reqs = batch_of(5)
    Driver(parts, overlap).run(*reqs)
    for r in reqs:
        assert r.output_ids == expected(r) and parts.emitted.tokens(r.rid) == expected(r)
        assert r.finish_reason is FinishReason.LENGTH and r.req_pool_idx is None and not r.futures
        assert [o.finish_reason for o in parts.emitted.of(r.rid)][-1] == "length"
    assert slots_accounted(parts.kv) and not parts.decode.running
    assert parts.counters.num_prompt_tokens == 20 and parts.counters.num_generated_tokens == 30


def test_overlap_changes_when_tokens_are_read_not_which_tokens_or_how_many_passes() -> None:
    plain, overlapped = make_parts(schedule_policy="fcfs"), make_parts(schedule_policy="fcfs")
    a, b = Driver(plain, overlap=False), Driver(overlapped, overlap=True)
    a.run(*batch_of(3, max_new_tokens=5))
    b.run(*batch_of(3, max_new_tokens=5))
    assert all(plain.emitted.tokens(f"r{i}") == overlapped.emitted.tokens(f"r{i}") for i in range(3))
    assert [len(x.reqs) for x in a.batches] == [len(x.reqs) for x in b.batches]


def test_the_same_prompts_again_reuse_the_cache_but_one_token() -> None:
    parts = make_parts(schedule_policy="fcfs")
    driver = Driver(parts, overlap=True)
    driver.run(*batch_of(3))
    first_prompt_tokens = parts.counters.num_prompt_tokens
    again = [req(f"again{i}", prompt_len=4, max_new_tokens=6, first_id=1 + 10 * i) for i in range(3)]
    driver.run(*again)
    assert [r.cached_tokens for r in again] == [3, 3, 3]  # the last prompt token is always computed
    assert [r.output_ids for r in again] == [expected(r) for r in again]
    assert parts.counters.num_prompt_tokens == 2 * first_prompt_tokens and parts.counters.num_cached_tokens == 9
    assert slots_accounted(parts.kv)


@pytest.mark.parametrize("overlap", [False, True])
def test_running_out_of_kv_retracts_and_the_tokens_stay_the_same(overlap: bool) -> None:
    parts = make_parts(num_tokens=40, schedule_policy="fcfs", init_new_token_ratio=0.1, min_new_token_ratio=0.05)
    reqs = batch_of(4, prompt_len=4, max_new_tokens=14)  # 4 x 18 slots wanted, 40 there
    Driver(parts, overlap).run(*reqs)
    assert parts.counters.num_retractions > 0 and sum(r.num_retractions for r in reqs) == \
        parts.counters.num_retractions
    for r in reqs:
        assert r.output_ids == expected(r) and parts.emitted.tokens(r.rid) == expected(r)
    assert parts.counters.num_prompt_tokens == 16  # a re-admitted prompt is not counted again
    assert slots_accounted(parts.kv)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_long_prompt_in_chunks_joins_requests_already_decoding(overlap: bool) -> None:
    parts = make_parts(num_tokens=64, chunked_prefill_size=6, schedule_policy="fcfs")
    driver = Driver(parts, overlap)
    short = batch_of(2, prompt_len=3, max_new_tokens=8)
    long = req("long", prompt_len=20, max_new_tokens=3, first_id=50)
    for r in short:
        parts.prefill.enqueue(r)
    driver.step()
    driver.run(long)
    chunks = [b for b in driver.batches if long in b.reqs and not b.is_decode]
    assert [b.extend_lens[b.reqs.index(long)] for b in chunks] == [6, 6, 6, 2]
    for r in [*short, long]:
        assert r.output_ids == expected(r)
    assert parts.counters.num_prompt_tokens == 26 and slots_accounted(parts.kv)


def test_a_request_finished_from_outside_stops_and_the_rest_run_on() -> None:
    parts = make_parts(schedule_policy="fcfs")
    driver = Driver(parts, overlap=True)
    a, b = batch_of(2, max_new_tokens=10)
    for r in (a, b):
        parts.prefill.enqueue(r)
    for _ in range(4):
        driver.step()
    (taken,) = parts.decode.take("r0")
    parts.results.finish(taken, FinishReason.ABORT)
    driver.run()
    assert a.finish_reason is FinishReason.ABORT and len(a.output_ids) < 10
    assert a.output_ids == expected(a)[: len(a.output_ids)]  # what it got before the abort is right
    assert b.output_ids == expected(b) and parts.emitted.of("r0")[-1].finish_reason == "abort"
    assert slots_accounted(parts.kv)


def test_the_parts_share_one_set_of_counters_and_a_reset_is_seen_by_all() -> None:
    parts = make_parts(schedule_policy="fcfs")
    Driver(parts, overlap=False).run(*batch_of(2))
    counters = parts.counters
    assert counters.num_forward_passes > 0 and counters.num_generated_tokens == 12
    counters.reset()
    assert (counters.num_prompt_tokens, counters.num_generated_tokens, counters.num_forward_passes) == (0, 0, 0)
    assert counters.result_wait_s == 0.0 and counters.num_retractions == 0
    Driver(parts, overlap=False).run(*batch_of(1))
    assert parts.prefill.counters is counters and parts.results.counters is counters
    assert (counters.num_prompt_tokens, counters.num_generated_tokens) == (4, 6)


@pytest.mark.parametrize(("policy", "cached"), [("fcfs", 0), ("lpm", 3 * 12), ("dfs-weight", 3 * 12)])
def test_policies_change_what_is_cached_not_the_tokens(policy: str, cached: int) -> None:
    """Four prompts sharing 12 uncached tokens: the prefix-aware policies compute them once (the others wait a
    step and reuse them); fcfs computes them four times. Every request outputs the same tokens either way."""
    parts = make_parts(num_tokens=128, schedule_policy=policy, in_batch_prefix_threshold=4)
    params = req("x").params
    reqs = [Req(rid=f"s{i}", origin_input_ids=[*range(1, 13), 100 + i], params=params) for i in range(4)]
    Driver(parts, overlap=True).run(*reqs)
    assert parts.counters.num_cached_tokens == cached and [r.cached_tokens for r in reqs][1:] == [cached // 3] * 3
    for r in reqs:
        assert r.output_ids == expected(r)
    assert slots_accounted(parts.kv)
