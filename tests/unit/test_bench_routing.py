"""Pure helpers of `radixmesh bench routing`: histogram quantiles, decision counts, the report."""

from __future__ import annotations

import argparse
import math

from radixmesh.cluster.bench import ideal_hit_rate, markdown, paired_median, summarize_rounds
from radixmesh.cluster.bench_cluster import decision_counts, histogram_quantile

METRICS = """\
# HELP radixmesh_router_overhead_seconds x
# TYPE radixmesh_router_overhead_seconds histogram
radixmesh_router_overhead_seconds_bucket{le="0.0001"} 0.0
radixmesh_router_overhead_seconds_bucket{le="0.0002"} 4.0
radixmesh_router_overhead_seconds_bucket{le="0.0005"} 8.0
radixmesh_router_overhead_seconds_bucket{le="+Inf"} 10.0
radixmesh_router_overhead_seconds_count 10.0
radixmesh_router_overhead_seconds_sum 0.004
# HELP radixmesh_router_decisions_total x
# TYPE radixmesh_router_decisions_total counter
radixmesh_router_decisions_total{policy="cache-aware",reason="new-prefix",worker_id="a"} 3.0
radixmesh_router_decisions_total{policy="cache-aware",reason="new-prefix",worker_id="b"} 2.0
radixmesh_router_decisions_total{policy="approx-tree",reason="cache-hit",worker_id="a"} 1.0
"""


def test_histogram_quantile_interpolates_inside_the_bucket() -> None:
    # rank 5 of 10 falls in (0.0002, 0.0005] holding ranks 5..8: a quarter of the way in
    assert math.isclose(histogram_quantile(METRICS, "radixmesh_router_overhead_seconds", 0.5), 0.000275)
    assert math.isclose(histogram_quantile(METRICS, "radixmesh_router_overhead_seconds", 0.2), 0.0001 + 0.0001 * 0.5)
    assert histogram_quantile(METRICS, "radixmesh_router_overhead_seconds", 0.95) == 0.0005  # in +Inf: lower bound
    assert math.isnan(histogram_quantile(METRICS, "missing_seconds", 0.5))
    earlier = METRICS.replace('le="0.0002"} 4.0', 'le="0.0002"} 2.0').replace('le="0.0005"} 8.0', 'le="0.0005"} 2.0')
    earlier = earlier.replace('le="+Inf"} 10.0', 'le="+Inf"} 2.0')
    # since `earlier`: 2 in (0.0001, 0.0002], 4 in (0.0002, 0.0005], 2 above; rank 4 of 8 is in the middle bucket
    assert math.isclose(histogram_quantile(METRICS, "radixmesh_router_overhead_seconds", 0.5, earlier),
                        0.0002 + 0.0003 * 0.5)


def test_decision_counts_by_policy_and_reason() -> None:
    assert decision_counts(METRICS) == {"cache-aware/new-prefix": 5, "approx-tree/cache-hit": 1}


def test_ideal_hit_rate_counts_each_group_prefix_once() -> None:
    from loadtests.fakes import WordTokenizer

    args = argparse.Namespace(gsp_num_groups=4, gsp_prompts_per_group=3, gsp_system_prompt_len=20,
                              gsp_question_len=5, gsp_output_len=2, seed=3)
    # 12 prompts of 25 words; 8 of them reuse their group's 20-word system prompt.
    assert math.isclose(ideal_hit_rate(args, WordTokenizer()), 8 * 20 / (12 * 25), rel_tol=0.02)


def test_rounds_and_report() -> None:
    rounds = [{"cache_hit_rate": 0.4, "ttft_p50_ms": 100.0, "decisions": {"a/b": 2}, "command": "x"},
              {"cache_hit_rate": 0.6, "ttft_p50_ms": 300.0, "decisions": {"a/b": 1}, "command": "x"}]
    summary = summarize_rounds(rounds)
    assert summary["cache_hit_rate"] == 0.5 and summary["ttft_p50_ms"] == 200.0
    assert summary["decisions"] == {"a/b": 3} and summary["num_rounds"] == 2
    assert math.isclose(paired_median([0.010, 0.020, 0.030], [0.009, 0.018, 0.020]), 2.0)
    run = {"cache_hit_rate": 0.5, "hit_rate_vs_ideal": 0.8, "request_throughput": 1.0, "output_throughput": 8.0,
           "ttft_p50_ms": 100.0, "ttft_p99_ms": 200.0, "router_overhead_p50_ms": 0.3,
           "router_overhead_idle_p50_ms": 0.2, "routed_minus_direct_p50_ms": None, "decision_p50_ms": 0.2,
           "decision_idle_p50_ms": float("nan"), "direct_ttft_p50_ms": 50.0, "num_rounds": 1}
    result = {"device": {"kind": "cpu", "name": "x", "cores": 2}, "num_workers": 2, "model": "m", "worker_args": "",
              "workload": {"num_groups": 4, "prompts_per_group": 3, "system_prompt_len": 100, "question_len": 8,
                           "output_len": 4, "request_rate": "inf", "max_concurrency": 2},
              "command": "radixmesh bench routing", "ideal_hit_rate": 0.6, "runs": {"cache-aware": run}}
    text = markdown(result)
    assert "| cache-aware | 0.500 | 0.80 |" in text and "| 0.200 / 0.300 | n/a / 0.200 |" in text
    assert "CPU (x, 2 cores)" in text
