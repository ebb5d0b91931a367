"""Prometheus metrics of a worker (served on its --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

REQUESTS = Counter("radixmesh_worker_requests_total", "Finished Generate calls", ["finish_reason"])
PROMPT_TOKENS = Counter("radixmesh_worker_prompt_tokens_total", "Prompt tokens of finished sequences")
CACHED_TOKENS = Counter("radixmesh_worker_cached_tokens_total", "Prompt tokens served from the prefix cache")
GENERATED_TOKENS = Counter("radixmesh_worker_generated_tokens_total", "Output tokens streamed")
RUNNING = Gauge("radixmesh_worker_running_requests", "Generate calls in flight")
TTFT = Histogram("radixmesh_worker_time_to_first_token_seconds", "Admission to first token",
                 buckets=_LATENCY_BUCKETS)
E2E = Histogram("radixmesh_worker_e2e_request_latency_seconds", "Admission to last token", buckets=_LATENCY_BUCKETS)
KV_USAGE = Gauge("radixmesh_worker_kv_usage", "Fraction of KV slots in use (at the last GetLoad)")
