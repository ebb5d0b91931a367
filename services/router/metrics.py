"""Prometheus metrics of the router (served on its --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_FINE_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01,
                 0.025, 0.05, 0.1, 0.25, 1.0)

DECISIONS = Counter("radixmesh_router_decisions_total", "Routing decisions", ["policy", "reason", "worker_id"])
RETRIES = Counter("radixmesh_router_retries_total", "Requests retried on another worker before the first token")
FAILURES = Counter("radixmesh_router_failed_streams_total", "Routed streams that ended with an error", ["code"])
OVERHEAD = Histogram("radixmesh_router_overhead_seconds",
                     "Time the router adds to a request: receipt to worker call, plus forwarding the first message",
                     buckets=_FINE_BUCKETS)
DECISION = Histogram("radixmesh_router_decision_seconds", "Time of one routing decision (index lookup included)",
                     buckets=_FINE_BUCKETS)
HEALTHY_WORKERS = Gauge("radixmesh_router_healthy_workers", "Workers passing health checks")
FALLBACK = Gauge("radixmesh_router_index_fallback", "1 while cache-aware routes with approx-tree (Redis down)")
