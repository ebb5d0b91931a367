"""Metrics of a fixed synthetic trace against values computed by hand."""

from __future__ import annotations

import math

import pytest

from loadtests.client import parse_server_timing
from loadtests.metrics import LengthFit, cache_hit_rate, percentile, summarize, throughput_timeline
from loadtests.records import RequestResult


def make_trace() -> list[RequestResult]:
    """Four successful requests and one failure; the run lasts 4 s (the last one ends at 1 + 3)."""

    def ok(i: int, start: float, latency: float, ttft: float, itl: list[float], prompt: int, out: int,
           cached: int | None) -> RequestResult:
        return RequestResult(session_id=i, turn_index=0, success=True, prompt_len=prompt, output_len=out,
                             start_s=start, latency_s=latency, ttft_s=ttft, itl_s=itl, cached_len=cached)

    return [
        ok(0, 0.0, 1.0, 0.2, [0.1, 0.1, 0.2], 100, 4, 50),
        ok(1, 0.5, 2.0, 0.4, [0.3, 0.5], 200, 3, 0),
        ok(2, 1.0, 1.5, 0.3, [0.4], 100, 2, 100),
        ok(3, 1.0, 3.0, 1.0, [], 100, 1, None),
        RequestResult(session_id=4, turn_index=0, success=False, prompt_len=999, output_len=0, start_s=2.0,
                      latency_s=0.1, error="HTTP 500: boom", status=500),
    ]


def test_percentile_interpolates_linearly() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summary_counts_and_throughput() -> None:
    s = summarize(make_trace(), duration_s=4.0)
    assert (s.num_completed, s.num_failed) == (4, 1)
    assert (s.total_input_tokens, s.total_output_tokens) == (500, 10)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.input_throughput == pytest.approx(125.0)
    assert s.output_throughput == pytest.approx(2.5)
    assert s.total_throughput == pytest.approx(127.5)
    assert s.concurrency == pytest.approx(7.5 / 4)


def test_summary_latency_percentiles() -> None:
    s = summarize(make_trace(), duration_s=4.0)
    # TTFT ms sorted: 200 300 400 1000
    assert (s.ttft.mean_ms, s.ttft.median_ms, s.ttft.p90_ms, s.ttft.p99_ms) == pytest.approx((475, 350, 820, 982))
    # ITL ms sorted: 100 100 200 300 400 500
    assert (s.itl.mean_ms, s.itl.median_ms, s.itl.p90_ms, s.itl.p99_ms) == pytest.approx((1600 / 6, 250, 450, 495))
    # E2E ms sorted: 1000 1500 2000 3000
    assert (s.e2e.mean_ms, s.e2e.median_ms, s.e2e.p90_ms, s.e2e.p99_ms) == pytest.approx((1875, 1750, 2700, 2970))
    # TPOT ms: 800/3, 1600/2, 1200/1 (the one-token request has none)
    assert s.tpot.count == 3
    assert (s.tpot.mean_ms, s.tpot.median_ms, s.tpot.p90_ms, s.tpot.p99_ms) == pytest.approx(
        ((800 / 3 + 800 + 1200) / 3, 800, 1120, 1192))
    assert s.ttft.count == 4 and s.itl.count == 6 and s.e2e.count == 4


def test_cache_hit_rate_uses_only_reported_counts() -> None:
    trace = make_trace()
    assert summarize(trace, 4.0).cache_hit_rate == pytest.approx(150 / 400)
    assert cache_hit_rate([trace[3]]) is None
    assert cache_hit_rate([]) is None


def test_throughput_timeline_bins() -> None:
    timeline = throughput_timeline(make_trace(), bin_s=1.0)
    assert [t for t, _, _ in timeline] == [0.0, 1.0, 2.0, 3.0]
    assert [tok for _, tok, _ in timeline] == pytest.approx([5, 4, 1, 0])
    assert [req for _, _, req in timeline] == pytest.approx([0, 1, 2, 1])
    assert throughput_timeline([], 1.0) == []


def test_summary_of_nothing_is_nan_not_an_error() -> None:
    s = summarize([], duration_s=0.0)
    assert s.num_completed == 0 and math.isnan(s.request_throughput)
    assert s.to_dict()["ttft"]["mean_ms"] is None


def test_ttft_fit_over_uncached_prompt_length() -> None:
    # TTFT = 30 ms + 15 ms per 1k computed tokens; a fully cached prefix is not computed
    results = [RequestResult(0, 0, True, n, 1, 0.0, 1.0, ttft_s=(30 + 15 * (n - cached) / 1000) / 1e3,
                             cached_len=cached) for n, cached in ((500, 0), (1500, 0), (3000, 1000), (4000, 0))]
    fit = summarize(results, 1.0).ttft_fit
    assert fit is not None and fit.count == 4
    assert fit.intercept_ms == pytest.approx(30.0) and fit.per_1k_ms == pytest.approx(15.0)
    assert LengthFit.of([100, 100, 100], [0.01, 0.02, 0.03]) is None  # one length: no slope
    assert LengthFit.of([100, 200], [0.01, 0.02]) is None


def test_server_timing_header_is_parsed() -> None:
    assert parse_server_timing("tokenize;dur=3.25") == {"tokenize": 3.25}
    assert parse_server_timing('db;desc="x";dur=1, tokenize;dur="2", cache, bad;dur=x') == {"db": 1.0,
                                                                                            "tokenize": 2.0}
    assert parse_server_timing("") == {}
