"""The model-server protocol's metrics: what endpoint pickers of the Gateway API Inference Extension scrape from
every member of an InferencePool (its `/metrics`, on the pool's target port).

The protocol asks for two gauges, the requests waiting in the engine's queue and the KV-cache utilisation (a
fraction, 0 to 1), and lets each server name them; pickers are configured with the names, and the extension's
reference picker (and its chart's default `modelServerType: vllm`) reads vLLM's. radixmesh exports them under
those names, with the running requests beside them, so a stock picker needs no flags. A server with LoRA on also
exports `vllm:lora_requests_info` as the protocol has it: labels `running_lora_adapters` and `waiting_lora_adapters`
(comma-separated adapter names) and `max_lora` (adapters one batch may mix), the value the time of the stats.
"""

from __future__ import annotations

import time
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
LORA_INFO = "vllm:lora_requests_info"
"""The adapters with running and with waiting requests, and the most adapters per batch (LoRA affinity)."""


class ModelServerMetrics(Collector):
    """The three gauges from the engine's last stats (set by `update` at each scrape), labelled model_name."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}
        self.model_name = ""

    def update(self, stats: dict[str, Any]) -> None:
        self.stats = dict(stats)
        self.updated_at = time.time()

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        for name, doc, value in (
                (WAITING, "Requests in the engine's queue (model-server protocol)", stats.get("num_waiting_reqs")),
                (RUNNING, "Requests the engine runs (model-server protocol)", stats.get("num_running_reqs")),
                (KV_USAGE, "KV-cache utilisation, 0 to 1 (model-server protocol)", stats.get("kv_usage"))):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(value or 0))
            yield family
        if stats.get("max_loras_per_batch"):
            yield self._lora_info(stats)

    def _lora_info(self, stats: dict[str, Any]) -> Metric:
        family = GaugeMetricFamily(LORA_INFO, "LoRA adapters with running and waiting requests (model-server "
                                   "protocol)", labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        running = ",".join(sorted(n for n, c in (stats.get("lora_running") or {}).items() if c))
        waiting = ",".join(sorted(n for n, c in (stats.get("lora_waiting") or {}).items() if c))
        family.add_metric([running, waiting, str(int(stats["max_loras_per_batch"]))], getattr(self, "updated_at", 0.0))
        return family
