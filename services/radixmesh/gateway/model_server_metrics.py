"""The model-server protocol's metrics: what endpoint pickers of the Gateway API Inference Extension scrape from
every member of an InferencePool (its `/metrics`, on the pool's target port).

The protocol asks for two gauges, the requests waiting in the engine's queue and the KV-cache utilisation (a
fraction, 0 to 1), and lets each server name them; pickers are configured with the names, and the extension's
reference picker (and its chart's default `modelServerType: vllm`) reads vLLM's. radixmesh exports them under
those names, with the running requests beside them, so a stock picker needs no flags. LoRA adapter info
(`vllm:lora_requests_info`) is not exported: radixmesh serves no adapters yet.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

WAITING = "vllm:num_requests_waiting"
"""TotalQueuedRequests: sequences waiting for admission to the engine."""
RUNNING = "vllm:num_requests_running"
"""Sequences the engine is running (prefill or decode)."""
KV_USAGE = "vllm:gpu_cache_usage_perc"
"""KVCacheUtilization: share of the KV pool in use, 0 to 1 (vLLM's name says percent; its value is a fraction)."""


class ModelServerMetrics(Collector):
    """The three gauges from the engine's last stats (set by `update` at each scrape), labelled model_name."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}
        self.model_name = ""

    def update(self, stats: dict[str, Any]) -> None:
        self.stats = dict(stats)

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        for name, doc, value in (
                (WAITING, "Requests in the engine's queue (model-server protocol)", stats.get("num_waiting_reqs")),
                (RUNNING, "Requests the engine runs (model-server protocol)", stats.get("num_running_reqs")),
                (KV_USAGE, "KV-cache utilisation, 0 to 1 (model-server protocol)", stats.get("kv_usage"))):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(value or 0))
            yield family
