"""Prometheus metrics of the gateway (prefix `radixmesh_`), in a registry of its own.

Counters and histograms move as requests run; the engine gauges (running and queued
sequences, KV usage) are read from the backend when /metrics is scraped.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from radixmesh.common.lora_metrics import LoraStatsCollector
from radixmesh.common.metrics import (
    E2E_BUCKETS_S,
    ITL_BUCKETS_S,
    OVERHEAD_BUCKETS_S,
    QUEUE_BUCKETS_S,
    TTFT_BUCKETS_S,
    LabelledRegistry,
)
from radixmesh.common.moe_metrics import MoeStatsCollector
from radixmesh.common.spec_metrics import SpecStatsCollector
from radixmesh.gateway.model_server_metrics import ModelServerMetrics

__all__ = ["CONTENT_TYPE_LATEST", "GatewayMetrics"]


class GatewayMetrics:
    """Owns the metric objects; the HTTP layer calls the `observe_*` methods."""

    def __init__(self, model_name: str, service: str = "gateway") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.exposed = LabelledRegistry(self.registry, {"service": service})
        """What /metrics renders: every series labelled service="gateway" (or "serve", "worker" with a local
        engine: `radixmesh serve`, a worker's --http-port)."""
        self._views: list[LabelledRegistry] = []
        reg, p = self.registry, "radixmesh_"
        self.http_requests = Counter(p + "http_requests", "HTTP responses by route and status",
                                     ["route", "status"], registry=reg)
        self.requests = Counter(p + "requests", "Generation requests admitted, by API endpoint",
                                ["endpoint"], registry=reg)
        self.finished = Counter(p + "requests_finished", "Sequences finished, by finish reason",
                                ["finish_reason"], registry=reg)
        self.client_disconnects = Counter(p + "client_disconnects", "Clients that went away before their request "
                                          "was whole (http) or before its answer (grpc), by API", ["api"],
                                          registry=reg)
        for api in ("http", "grpc"):  # the series exist before the first one
            self.client_disconnects.labels(api=api)
        self.rejected = Counter(p + "requests_rejected", "Generation requests refused because the queue was full",
                                registry=reg)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests", registry=reg)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens", registry=reg)
        self.cached_tokens = Counter(p + "cached_tokens", "Prompt tokens served from the prefix cache",
                                     registry=reg)
        self.lora_finished = Counter(p + "lora_requests_finished", "Sequences of a LoRA adapter finished",
                                     ["adapter"], registry=reg)
        self.lora_tokens = Counter(p + "lora_generation_tokens", "Output tokens of a LoRA adapter's sequences",
                                   ["adapter"], registry=reg)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time from arrival to the first output token",
                              buckets=TTFT_BUCKETS_S, registry=reg)
        self.ttft_overhead = Histogram(
            p + "ttft_overhead_seconds", "Time from arrival to the first output token that the engine did not spend "
            "(the front end; in a cluster also the hops, the router and the worker's front end)",
            buckets=OVERHEAD_BUCKETS_S, registry=reg)
        self.tokenize = Histogram(
            p + "tokenize_seconds", "Time a request's prompt text took to become token ids (waiting for a tokenizer "
            "thread included; a gateway's own pool, or its tokenizer service call with --tokenize service)",
            buckets=OVERHEAD_BUCKETS_S, registry=reg)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between output tokens of a sequence",
                             buckets=ITL_BUCKETS_S, registry=reg)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Time from arrival to the last output token",
                             buckets=E2E_BUCKETS_S, registry=reg)
        self.queue_time: Histogram | None = None
        """Engine queue wait: with a local engine only (the workers report theirs)."""
        local = service != "gateway"
        if local:
            self.queue_time = Histogram(p + "queue_time_seconds", "Time from arrival to the first prefill batch",
                                        buckets=QUEUE_BUCKETS_S, registry=reg)
        self.running = Gauge(p + "num_running_requests", "Sequences the engine is running", registry=reg)
        self.queued = Gauge(p + "num_queued_requests", "Sequences waiting in the engine's queue", registry=reg)
        self.in_flight = Gauge(p + "num_gateway_requests", "Sequences admitted by the gateway and not finished",
                               registry=reg)
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "Share of KV slots held by running requests",
                              registry=reg)
        self.kv_used = Gauge(p + "kv_used_tokens", "KV slots held by running requests", registry=reg)
        self.kv_capacity = Gauge(p + "kv_capacity_tokens", "KV slots in the pool", registry=reg)
        self.cache_hit_rate = Gauge(p + "cache_hit_rate", "Share of prompt tokens served from the prefix cache",
                                    registry=reg)
        self.model_info = Gauge(p + "model_info", "The served model (value is always 1)", ["model_name"], registry=reg)
        self.speculative: SpecStatsCollector | None = None
        """Speculative decoding series: with a local engine only (the workers report theirs)."""
        self.model_server: ModelServerMetrics | None = None
        """The model-server protocol's gauges (what inference-pool pickers scrape): with a local engine only."""
        self.moe: MoeStatsCollector | None = None
        """Expert-load series of MoE models: with a local engine only."""
        self.lora: LoraStatsCollector | None = None
        """Loaded LoRA adapters and their running and waiting sequences: with a local engine only."""
        if local:
            self.speculative = SpecStatsCollector()
            reg.register(self.speculative)
            self.moe = MoeStatsCollector()
            reg.register(self.moe)
            self.lora = LoraStatsCollector()
            reg.register(self.lora)
            self.model_server = ModelServerMetrics()
            reg.register(self.model_server)
        self.set_model_name(model_name)

    def set_model_name(self, model_name: str) -> None:
        """Name the served model (a gateway learns it once its dependencies answer)."""
        self.model_info.clear()
        if self.model_server is not None:
            self.model_server.model_name = model_name
        if model_name:
            self.model_info.labels(model_name=model_name).set(1)

    def observe_http(self, route: str, status: int) -> None:
        self.http_requests.labels(route=route, status=str(status)).inc()

    def observe_client_gone(self, api: str) -> None:
        """A client left early (http: before its whole body; grpc: before its answer)."""
        self.client_disconnects.labels(api=api).inc()

    def observe_admitted(self, endpoint: str, prompt_tokens: int) -> None:
        self.requests.labels(endpoint=endpoint).inc()
        self.prompt_tokens.inc(prompt_tokens)

    def observe_first_token(self, elapsed_s: float, cached_tokens: int, engine_s: float | None = None) -> None:
        """`engine_s`: the engine's share of `elapsed_s` (its call to its first message), when the backend knows."""
        self.ttft.observe(elapsed_s)
        self.cached_tokens.inc(cached_tokens)
        if engine_s is not None:
            self.ttft_overhead.observe(max(0.0, elapsed_s - engine_s))

    def observe_tokens(self, num_tokens: int, gap_s: float | None) -> None:
        """`num_tokens` new tokens arrived together, `gap_s` after the sequence's previous ones."""
        self.generation_tokens.inc(num_tokens)
        if gap_s is not None and num_tokens > 0:
            per_token_s = gap_s / num_tokens
            for _ in range(num_tokens):
                self.itl.observe(per_token_s)

    def observe_adapter(self, adapter: str, num_tokens: int, finished: bool) -> None:
        """Tokens (and the end) of a sequence of LoRA adapter `adapter`."""
        self.lora_tokens.labels(adapter=adapter).inc(num_tokens)
        if finished:
            self.lora_finished.labels(adapter=adapter).inc()

    def observe_finished(self, finish_reason: str, elapsed_s: float) -> None:
        self.finished.labels(finish_reason=finish_reason).inc()
        self.e2e.observe(elapsed_s)

    def update_engine(self, stats: dict[str, Any], in_flight: int) -> None:
        self.running.set(float(stats.get("num_running_reqs", 0)))
        self.queued.set(float(stats.get("num_waiting_reqs", 0)))
        self.kv_usage.set(float(stats.get("kv_usage", 0.0)))
        self.kv_used.set(float(stats.get("kv_used_tokens", 0)))
        self.kv_capacity.set(float(stats.get("max_total_num_tokens", 0)))
        self.cache_hit_rate.set(float(stats.get("cache_hit_rate", 0.0)))
        self.in_flight.set(in_flight)
        if self.speculative is not None:
            self.speculative.update(stats)
        if self.moe is not None:
            self.moe.update(stats)
        if self.lora is not None:
            self.lora.update(stats)
        if self.model_server is not None:
            self.model_server.update(stats)

    def add_view(self, collector: Any, service: str) -> None:
        """Render `collector`'s metrics too, labelled service=`service` (a part running in this process)."""
        self._views.append(LabelledRegistry(collector, {"service": service}))

    def render(self) -> bytes:
        return b"".join([generate_latest(self.exposed), *(generate_latest(view) for view in self._views)])
