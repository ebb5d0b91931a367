"""What every service's Prometheus metrics share: the `radixmesh_` names' buckets and the process labels.

Each process exposes its metrics with constant labels naming where they come from:
`service` (gateway | serve | tokenizer | router | worker | grammar) always, `role` and
`worker` on workers. They are added when /metrics is scraped (`LabelledRegistry`), so the
metric objects themselves only carry the labels that vary per sample (finish_reason, policy...).
A sample that has a label of the same name keeps its own (the router's per-worker series).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OVERHEAD_BUCKETS_S = (*(i / 4000 for i in range(1, 41)), 0.0125, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0)
"""Serving-path overhead: 0.25 ms steps up to 10 ms (a median of two paths compared to a fraction of a ms)."""
TRANSFER_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
GRAMMAR_COMPILE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_process_labels: dict[str, str] = {}


def set_process_labels(**labels: str) -> None:
    """Constant labels of this process's series (service=..., role=..., worker=...); empty values drop one."""
    for name, value in labels.items():
        if value:
            _process_labels[name] = value
        else:
            _process_labels.pop(name, None)


def process_labels() -> dict[str, str]:
    return dict(_process_labels)


class LabelledRegistry(CollectorRegistry):
    """A view of `registry` whose every sample also carries the process labels (read at each scrape)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY, labels: dict[str, str] | None = None) -> None:
        super().__init__(auto_describe=False)
        self.registry = registry
        self.labels = labels
        """Labels of this view; None: the process labels."""

    def collect(self) -> Iterator[Metric]:
        extra = self.labels if self.labels is not None else process_labels()
        for family in self.registry.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [s._replace(labels={**extra, **s.labels}) for s in family.samples]
            yield labelled


class BucketCounts:
    """A histogram as plain numbers, for a process without an exporter (the scheduler): `stats(prefix)` goes
    out with its stats dict, and `histogram_from_stats` rebuilds the histogram where /metrics is served."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        """Cumulative: counts[i] observations were <= buckets[i]."""
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.count += 1
        self.sum += value

    def stats(self, prefix: str) -> dict[str, float]:
        out = {f"{prefix}_bucket_{i}": float(c) for i, c in enumerate(self.counts)}
        return {**out, f"{prefix}_count": float(self.count), f"{prefix}_sum": self.sum}


def histogram_from_stats(name: str, documentation: str, buckets: tuple[float, ...], stats: dict[str, float],
                         prefix: str) -> HistogramMetricFamily:
    """The histogram `BucketCounts.stats(prefix)` described (all zero before the first stats arrive)."""
    count = float(stats.get(f"{prefix}_count", 0))
    pairs = [(floatToGoString(bound), float(stats.get(f"{prefix}_bucket_{i}", 0))) for i, bound in enumerate(buckets)]
    return HistogramMetricFamily(name, documentation, buckets=[*pairs, ("+Inf", count)],
                                 sum_value=float(stats.get(f"{prefix}_sum", 0.0)))
