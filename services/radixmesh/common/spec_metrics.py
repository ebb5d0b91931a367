"""Prometheus series of speculative decoding, from the scheduler's stats (worker and `serve`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

SPEC_COUNTERS: dict[str, tuple[str, str]] = {
    "spec_num_draft_tokens": ("radixmesh_spec_draft_tokens",
                              "Draft tokens proposed and verified (speculative decoding)"),
    "spec_num_accepted_tokens": ("radixmesh_spec_accepted_tokens", "Draft tokens the target accepted"),
}
SPEC_GAUGES: dict[str, tuple[str, str]] = {
    "spec_accept_length": ("radixmesh_spec_accept_length",
                           "Mean tokens per request and verify pass (accepted drafts + 1) since start"),
}


class SpecStatsCollector(Collector):
    """The speculative series of the scheduler's last stats (0 while speculation is off)."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

    def update(self, stats: dict[str, Any]) -> None:
        self.stats = dict(stats)

    def collect(self) -> Iterator[Metric]:
        for key, (name, doc) in SPEC_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(self.stats.get(key, 0)))
        for key, (name, doc) in SPEC_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(self.stats.get(key, 0)))
