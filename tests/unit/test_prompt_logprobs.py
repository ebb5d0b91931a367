"""Prompt-token log-probs on a tiny random model: every scheduling path gives the single-run values.

The reference is each request alone with no cache and no chunking; the paths under test
batch requests, chunk prompts, reuse cached prefixes (admission must stop the match before
`logprob_start_len`) and overlap launches. The real model is checked against Hugging Face in
tests/integration/test_prompt_logprobs.py.
"""

from __future__ import annotations

import math

import msgspec
import pytest

from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.core import Scheduler
from radixmesh.wire.messages import TokenOut

from .scheduler_factory import Collector, assert_no_leak, clone, make_requests, make_scheduler, run_until_idle


class LogprobCollector(Collector):
    """Also gathers prompt log-probs (and their top alternatives) per request."""

    def __init__(self) -> None:
        super().__init__()
        self.input_logprobs: dict[str, list[float | None]] = {}
        self.input_top: dict[str, list[list[tuple[int, float]] | None]] = {}

    def __call__(self, outputs: list[TokenOut]) -> None:
        super().__call__(outputs)
        for out in outputs:
            self.input_logprobs.setdefault(out.rid, []).extend(out.input_logprobs or [])
            self.input_top.setdefault(out.rid, []).extend(out.input_top_logprobs or [])


def scheduler(**overrides: object) -> tuple[Scheduler, LogprobCollector]:
    sched, _ = make_scheduler(**overrides)
    collector = LogprobCollector()
    sched.emit = collector
    return sched, collector


def with_start(req: Req, start: int, top: int = 0) -> Req:
    params = msgspec.structs.replace(req.params, logprob_start_len=start, top_logprobs=top)
    return Req(rid=req.rid, origin_input_ids=list(req.origin_input_ids), params=params)


def single_run(req: Req) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    sched, col = scheduler(chunked_prefill_size=-1, disable_radix_cache=True)
    sched.add_request(clone(req))
    run_until_idle(sched)
    return col.input_logprobs[req.rid], col.input_top[req.rid]


def assert_close(got: list[float | None], want: list[float | None]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None and w is not None:
            assert math.isclose(g, w, rel_tol=1e-4, abs_tol=1e-4), (g, w)


Expected = dict[str, tuple[list[float | None], list[list[tuple[int, float]] | None]]]


@pytest.fixture(scope="module")
def workload() -> list[Req]:
    reqs = make_requests(4, seed=5, shared_prefix_len=12, max_new_tokens=3)
    starts = [0, 5, 13, 20]  # before, inside and after the shared prefix
    return [with_start(r, min(s, len(r.origin_input_ids) - 1), top=2 if i % 2 else 0)
            for i, (r, s) in enumerate(zip(reqs, starts))]


@pytest.fixture(scope="module")
def expected(workload: list[Req]) -> Expected:
    return {req.rid: single_run(req) for req in workload}


def test_single_run_shape(workload: list[Req], expected: Expected) -> None:
    for req in workload:
        values, top = expected[req.rid]
        start = req.params.logprob_start_len
        assert len(values) == len(req.origin_input_ids) - start
        assert (values[0] is None) == (start == 0)
        assert all(v is not None and v <= 0 for v in values[1:])
        if req.params.top_logprobs:
            assert len(top) == len(values)
            for value, row, token in zip(values[1:], top[1:], req.origin_input_ids[start + 1:]):
                assert row is not None and len(row) == 2 and row[0][1] >= row[1][1]
                assert value is not None and value <= row[0][1] + 1e-6
                assert token != row[0][0] or math.isclose(value, row[0][1], abs_tol=1e-5)
        else:
            assert top == []


@pytest.mark.parametrize("overrides", [
    {},
    {"chunked_prefill_size": 5},
    {"overlap_schedule": "on", "chunked_prefill_size": 7},
], ids=["batched", "chunked", "overlap-chunked"])
def test_every_path_matches_single_runs(workload: list[Req], expected: Expected,
                                        overrides: dict[str, object]) -> None:
    sched, col = scheduler(**overrides)
    # Warm the cache with the whole first prompt: later requests share 12 tokens of it.
    warm = clone(workload[0])
    warm.rid = "warm"
    sched.add_request(with_start(warm, -1))
    run_until_idle(sched)
    for req in workload:
        sched.add_request(clone(req))
    run_until_idle(sched)
    for req in workload:
        values, top = expected[req.rid]
        assert_close(col.input_logprobs[req.rid], values)
        assert len(col.input_top[req.rid]) == len(top)
        # admission reused the cache up to the position before the first scored token
        assert col.cached[req.rid] == min(max(req.params.logprob_start_len - 1, 0), 12)
    assert_no_leak(sched)


def test_requests_without_prompt_logprobs_keep_their_cache_hits(workload: list[Req]) -> None:
    sched, col = scheduler()
    first, second = (with_start(clone(r), -1) for r in workload[:2])
    sched.add_request(first)
    run_until_idle(sched)
    sched.add_request(second)
    run_until_idle(sched)
    assert col.cached[second.rid] >= 12
    assert col.input_logprobs[second.rid] == []
