"""Prometheus metrics of a worker (served on its --metrics-port, labelled service="worker", role, worker).

The names are the gateway's where the quantity is the same (TTFT, inter-token and end-to-end
latency, tokens, finished requests), so one dashboard query covers both tiers through the
`service` label. The engine's own figures (running and queued sequences, KV usage, cache hit
rate, grammar counters) come from the scheduler process's stats, refreshed every second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any, ClassVar

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixmesh.common.lora_metrics import lora_metric_families
from radixmesh.common.metrics import (
    E2E_BUCKETS_S,
    GRAMMAR_COMPILE_BUCKETS_S,
    ITL_BUCKETS_S,
    QUEUE_BUCKETS_S,
    TRANSFER_BUCKETS_S,
    TTFT_BUCKETS_S,
    histogram_from_stats,
    set_process_labels,
)
from radixmesh.common.moe_metrics import moe_metric_families
from radixmesh.common.spec_metrics import SPEC_COUNTERS, SPEC_GAUGES
from radixmesh.worker.load import LoadTracker

logger = logging.getLogger(__name__)
ENGINE_STATS_INTERVAL_S = 1.0

REQUESTS = Counter("radixmesh_requests_finished", "Sequences finished, by finish reason", ["finish_reason"])
PROMPT_TOKENS = Counter("radixmesh_prompt_tokens", "Prompt tokens of finished sequences")
CACHED_TOKENS = Counter("radixmesh_cached_tokens", "Prompt tokens served from the prefix cache")
GENERATED_TOKENS = Counter("radixmesh_generation_tokens", "Output tokens streamed")
LORA_FINISHED = Counter("radixmesh_lora_requests_finished", "Sequences of a LoRA adapter finished", ["adapter"])
LORA_TOKENS = Counter("radixmesh_lora_generation_tokens", "Output tokens of a LoRA adapter's sequences", ["adapter"])
RUNNING = Gauge("radixmesh_num_inflight_requests", "Generate calls open on this worker")
QUEUED_PREFILL_TOKENS = Gauge("radixmesh_num_queued_prefill_tokens",
                              "Prompt tokens of admitted Generate calls not prefilled yet")
TTFT = Histogram("radixmesh_time_to_first_token_seconds", "Time from arrival to the first output token",
                 buckets=TTFT_BUCKETS_S)
ITL = Histogram("radixmesh_inter_token_latency_seconds", "Time between output tokens of a sequence",
                buckets=ITL_BUCKETS_S)
E2E = Histogram("radixmesh_e2e_request_latency_seconds", "Time from arrival to the last output token",
                buckets=E2E_BUCKETS_S)
QUEUE_TIME = Histogram("radixmesh_queue_time_seconds",
                       "Time from arrival to the first prefill batch (queue wait, grammar compilation included)",
                       buckets=QUEUE_BUCKETS_S)
KV_TRANSFER_BYTES = Counter("radixmesh_kv_transfer_bytes", "KV cache bytes moved between workers",
                            ["transport", "direction"])
KV_TRANSFER_SECONDS = Histogram("radixmesh_kv_transfer_seconds", "Time of one request's KV transfer",
                                ["transport", "direction"], buckets=TRANSFER_BUCKETS_S)
KV_TRANSFER_FALLBACKS = Counter("radixmesh_kv_transfer_fallbacks",
                                "KV transfers that fell back (to another transport or to recomputing)", ["reason"])
KV_RESERVATIONS = Counter("radixmesh_kv_reservations", "KV reservations asked for by decode, by outcome",
                          ["outcome"])
RESERVATION_OUTCOMES = ("granted", "refused")
KV_RESERVATION_WAIT = Histogram("radixmesh_kv_reservation_wait_seconds",
                                "Time from asking for a KV reservation to its grant (or refusal)",
                                buckets=QUEUE_BUCKETS_S)


class EngineStatsCollector(Collector):
    """The scheduler's last stats as series (set by `update`, read at each scrape)."""

    GAUGES: ClassVar[dict[str, tuple[str, str]]] = {
        "num_running_reqs": ("radixmesh_num_running_requests", "Sequences the engine is running"),
        "num_waiting_reqs": ("radixmesh_num_queued_requests", "Sequences waiting in the engine's queue"),
        "kv_usage": ("radixmesh_kv_cache_usage_ratio", "Share of KV slots held by running requests"),
        "kv_used_tokens": ("radixmesh_kv_used_tokens", "KV slots held by running requests"),
        "max_total_num_tokens": ("radixmesh_kv_capacity_tokens", "KV slots in the pool"),
        "cache_hit_rate": ("radixmesh_cache_hit_rate", "Share of prompt tokens served from the prefix cache"),
        "num_reserved_tokens": ("radixmesh_kv_reserved_tokens",
                                "KV slots held by decode reservations waiting for transferred KV"),
        "num_transfers_held": ("radixmesh_kv_exports_held",
                               "Prefilled prompts whose KV stays locked until the decode worker has it"),
        **SPEC_GAUGES,
    }
    COUNTERS: ClassVar[dict[str, tuple[str, str]]] = {
        "num_grammars_compiled": ("radixmesh_grammar_compiles", "Grammars compiled by this worker"),
        "num_grammar_cache_hits": ("radixmesh_grammar_cache_hits",
                                   "Structured-output requests whose grammar was in the worker's cache"),
        "num_grammars_fetched": ("radixmesh_grammar_fetches", "Grammars fetched from the grammar service"),
        "num_retractions": ("radixmesh_retractions", "Requests sent back to the queue for lack of KV memory"),
        "num_reservations_lapsed": ("radixmesh_kv_reservations_lapsed",
                                    "KV reservations whose lease ran out before commit (their slots were freed)"),
        "num_transfers_lapsed": ("radixmesh_kv_exports_lapsed",
                                 "Exported KV released by its lease rather than by the decode worker"),
        **SPEC_COUNTERS,
    }

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

    def update(self, stats: dict[str, Any]) -> None:
        self.stats = dict(stats)

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        for key, (name, doc) in self.GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(stats.get(key, 0)))
        for key, (name, doc) in self.COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(stats.get(key, 0)))
        yield from moe_metric_families(stats)
        yield from lora_metric_families(stats)
        yield histogram_from_stats("radixmesh_grammar_compile_seconds",
                                   "Time for the engine to get a compiled grammar (fetched or compiled here)",
                                   GRAMMAR_COMPILE_BUCKETS_S, stats, "grammar_compile_seconds")


ENGINE_STATS = EngineStatsCollector()
REGISTRY.register(ENGINE_STATS)


async def refresh_engine_stats(get_stats: Any, interval_s: float = ENGINE_STATS_INTERVAL_S) -> None:
    """Poll the scheduler's stats for the engine series until cancelled (a failed poll keeps the last ones)."""
    while True:
        with contextlib.suppress(Exception):
            ENGINE_STATS.update(await get_stats())
        await asyncio.sleep(interval_s)


def start_worker_metrics(get_stats: Any, load: LoadTracker, role: str, worker_id: str) -> asyncio.Task[None]:
    """Label this process's series with its role and id, and keep the engine series fresh (cancel the task)."""
    set_process_labels(role=role, worker=worker_id)
    QUEUED_PREFILL_TOKENS.set_function(lambda: load.num_queued_prefill_tokens)
    return asyncio.create_task(refresh_engine_stats(get_stats), name="worker-engine-stats")


def observe_reservation(outcome: str, seconds: float) -> None:
    """One KV reservation asked for by a decode worker (outcome: granted | refused) and its wait."""
    KV_RESERVATIONS.labels(outcome).inc()
    KV_RESERVATION_WAIT.observe(seconds)


def observe_kv_transfer(transport: str, direction: str, num_bytes: int, seconds: float) -> None:
    """One request's KV transfer (direction: send | receive); for the prefill/decode tiers."""
    KV_TRANSFER_BYTES.labels(transport, direction).inc(num_bytes)
    KV_TRANSFER_SECONDS.labels(transport, direction).observe(seconds)


KV_DIRECTIONS = ("send", "receive")
FALLBACK_REASONS = ("reservation_refused", "prefill_unavailable", "prefill_timeout", "prefill_error",
                    "transfer_failed", "lease_lapsed", "other")
"""Label values of radixmesh_kv_transfer_fallbacks (anything else counts as other)."""


def observe_kv_transfer_fallback(reason: str) -> None:
    """A request that could not use transferred KV and recomputed its prompt ("lease lapsed" -> lease_lapsed)."""
    label = reason.strip().lower().replace(" ", "_").replace("-", "_")
    KV_TRANSFER_FALLBACKS.labels(label if label in FALLBACK_REASONS else "other").inc()


def _declare_kv_series() -> None:
    """The KV-transfer series exist (at zero) from the start, on every role, so dashboards and alerts see them."""
    from radixmesh.engine.disagg.transport.registry import KV_TRANSPORT_IDS

    for transport in KV_TRANSPORT_IDS:
        for direction in KV_DIRECTIONS:
            KV_TRANSFER_BYTES.labels(transport, direction)
            KV_TRANSFER_SECONDS.labels(transport, direction)
    for reason in FALLBACK_REASONS:
        KV_TRANSFER_FALLBACKS.labels(reason)
    for outcome in RESERVATION_OUTCOMES:
        KV_RESERVATIONS.labels(outcome)


_declare_kv_series()
