"""Prometheus series of LoRA adapters, from the scheduler's stats (a worker's engine series, `serve`; docs/lora.md).

`radixmesh_lora_adapter_requests{adapter, state}` holds each loaded adapter's running and waiting sequences (both
series exist, at 0, for every loaded adapter, so counting them by adapter gives the workers holding it);
`radixmesh_lora_adapters_loaded` the adapters in host memory; `radixmesh_lora_slot_loads` counts adapters written
into device slots. A server without LoRA has no samples of the first and 0 for the others.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LORA_STATES = ("running", "waiting")


def lora_metric_families(stats: dict[str, Any]) -> Iterator[Metric]:
    adapters = list(stats.get("lora_adapters") or ())
    counts = {"running": stats.get("lora_running") or {}, "waiting": stats.get("lora_waiting") or {}}
    requests = GaugeMetricFamily("radixmesh_lora_adapter_requests", "Sequences of each loaded LoRA adapter, running "
                                 "or waiting", labels=["adapter", "state"])
    for name in adapters:
        for state in LORA_STATES:
            requests.add_metric([str(name), state], float(counts[state].get(name, 0)))
    yield requests
    yield GaugeMetricFamily("radixmesh_lora_adapters_loaded", "LoRA adapters in host memory", value=len(adapters))
    yield CounterMetricFamily("radixmesh_lora_slot_loads", "LoRA adapters written into device slots",
                              value=float(stats.get("lora_slot_loads", 0)))


class LoraStatsCollector(Collector):
    """The LoRA series of the scheduler's last stats (`radixmesh serve`, a worker's HTTP API)."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

    def update(self, stats: dict[str, Any]) -> None:
        self.stats = dict(stats)

    def collect(self) -> Iterator[Metric]:
        yield from lora_metric_families(self.stats)
