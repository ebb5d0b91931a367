"""Prometheus metrics of the router (served on its --metrics-port)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Counter, Gauge, Histogram

from radixmesh.router.breaker import CircuitState
from radixmesh.router.epp import metrics as epp_metrics  # noqa: F401  (the picker's series exist on every router)
from radixmesh.router.workers import WorkerHandle

_FINE_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01,
                 0.025, 0.05, 0.1, 0.25, 1.0)

DECISIONS = Counter("radixmesh_router_decisions_total", "Routing decisions by policy, outcome (reason) and worker",
                    ["policy", "reason", "worker"])
RETRIES = Counter("radixmesh_router_retries_total", "Requests retried on another worker before the first token")
MIGRATIONS = Counter("radixmesh_router_migrations_total",
                     "Streams moved to another worker after their first token, by reason: drain (the worker drained), "
                     "worker-lost (unreachable or died), worker-error (it failed the stream)", ["reason"])
MIGRATION_REASONS = ("drain", "worker-lost", "worker-error")
MIGRATION_GAP = Histogram("radixmesh_router_migration_gap_seconds",
                          "From a stream's break to the first token of the worker it moved to",
                          buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
REQUESTS = Counter("radixmesh_router_requests_total", "Routed Generate calls by policy and outcome",
                   ["policy", "outcome"])
OUTCOMES = ("ok", "error", "cancelled")
FAILURES = Counter("radixmesh_router_failed_streams_total", "Routed streams that ended with an error", ["code"])
OVERHEAD = Histogram("radixmesh_router_overhead_seconds",
                     "Time the router adds to a request: receipt to worker call, plus forwarding the first message",
                     buckets=_FINE_BUCKETS)
DECISION = Histogram("radixmesh_router_decision_seconds", "Time of one routing decision (index lookup included)",
                     buckets=_FINE_BUCKETS)
LORA_DECISIONS = Counter("radixmesh_router_lora_decisions_total",
                         "Requests of a LoRA adapter by how they were placed: holder (a worker holding it), loaded "
                         "(loaded on a worker first), spread (a hot adapter loaded on one more worker)",
                         ["adapter", "reason"])
LORA_LOADS = Counter("radixmesh_router_lora_loads_total",
                     "LoRA adapter loads this router made: route (for a request), api (a load call through it)",
                     ["adapter", "reason"])
HEALTHY_WORKERS = Gauge("radixmesh_router_healthy_workers", "Workers passing health checks")
FALLBACK = Gauge("radixmesh_router_index_fallback", "1 while cache-aware routes with approx-tree (Redis down)")
PD_DECISIONS = Counter("radixmesh_router_pd_decisions_total",
                       "Decisions for decode workers: prefill-tier (a prefill worker was named), short-prompt or "
                       "no-prefill-worker (the decode worker computes the prompt)", ["reason"])
CIRCUIT_STATE = Gauge("radixmesh_router_circuit_state", "1 for each worker's current circuit-breaker state",
                      ["worker", "state"])
WORKER_INFLIGHT = Gauge("radixmesh_router_worker_inflight_requests", "Requests this router has open on each worker",
                        ["worker"])
_known_workers: set[str] = set()


def update_worker_gauges(workers: Sequence[WorkerHandle]) -> None:
    """Per-worker series from the registry; a worker that left loses its series."""
    current = {w.worker_id for w in workers}
    for gone in _known_workers - current:
        WORKER_INFLIGHT.remove(gone)
        for state in CircuitState:
            CIRCUIT_STATE.remove(gone, state.value)
    _known_workers.clear()
    _known_workers.update(current)
    for w in workers:
        circuit = w.circuit_state
        for state in CircuitState:
            CIRCUIT_STATE.labels(w.worker_id, state.value).set(1 if circuit is state else 0)
        WORKER_INFLIGHT.labels(w.worker_id).set(w.num_inflight)
