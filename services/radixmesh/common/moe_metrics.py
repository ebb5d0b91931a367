"""Prometheus series of mixture-of-experts models, from the scheduler's stats (worker and `serve`).

`radixmesh_moe_expert_assignments{ep_rank}` counts the token-to-expert assignments the experts of each
expert-parallel rank processed, summed over the MoE layers (one rank, "0", without expert parallelism);
`radixmesh_moe_load_imbalance` is the busiest rank's count over the mean (1.0: balanced). Dense models have
no samples of the first and 0 for the second.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


def moe_metric_families(stats: dict[str, Any]) -> Iterator[Metric]:
    ranks = stats.get("moe_rank_assignments") or []
    per_rank = CounterMetricFamily("radixmesh_moe_expert_assignments",
                                   "Token-to-expert assignments processed by each expert-parallel rank's experts "
                                   "(all MoE layers)", labels=["ep_rank"])
    for rank, count in enumerate(ranks):
        per_rank.add_metric([str(rank)], float(count))
    yield per_rank
    mean = sum(ranks) / len(ranks) if ranks else 0.0
    yield GaugeMetricFamily("radixmesh_moe_load_imbalance",
                            "Assignments of the busiest expert-parallel rank over the ranks' mean (1 = balanced)",
                            value=max(ranks) / mean if mean else 0.0)


class MoeStatsCollector(Collector):
    """The MoE series of the scheduler's last stats."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

    def update(self, stats: dict[str, Any]) -> None:
        self.stats = dict(stats)

    def collect(self) -> Iterator[Metric]:
        yield from moe_metric_families(self.stats)
