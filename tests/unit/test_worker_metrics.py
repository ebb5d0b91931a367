"""A worker's engine series (worker/metrics.py) read the scheduler's stats by key: every key they read is one the
scheduler (with its hooks and the disaggregation handler) reports, and the KV-transfer series are declared and
labelled as dashboards expect."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY

from radixmesh.common.spec_metrics import SPEC_COUNTERS, SPEC_GAUGES
from radixmesh.engine.disagg.handler import DisaggHandler
from radixmesh.worker import metrics
from radixmesh.worker.metrics import FALLBACK_REASONS, EngineStatsCollector

from .scheduler_factory import make_requests, make_scheduler, run_until_idle


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    value = REGISTRY.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


@pytest.fixture(scope="module")
def stats() -> dict[str, Any]:
    """The stats of a scheduler that speculates and serves disaggregation, after some traffic."""
    sched, _ = make_scheduler(speculative_algorithm="ngram")
    DisaggHandler(sched, lambda msg: None, lambda query, result: None)
    for req in make_requests(2, seed=4, max_new_tokens=4):
        sched.add_request(req)
    run_until_idle(sched)
    return sched.stats()


def test_every_key_the_engine_series_read_is_in_the_schedulers_stats(stats: dict[str, Any]) -> None:
    read = {*EngineStatsCollector.GAUGES, *EngineStatsCollector.COUNTERS}
    missing = sorted(key for key in read if key not in stats)
    assert missing == []
    assert stats["grammar_compile_seconds_count"] == 0  # the compile-time histogram's source


def test_speculation_keys_are_reported_by_the_speculation_hook(stats: dict[str, Any]) -> None:
    for key in (*SPEC_GAUGES, *SPEC_COUNTERS):
        assert key in stats, key


def test_the_collector_reports_the_last_stats_and_zero_for_what_is_missing() -> None:
    collector = EngineStatsCollector()
    collector.update({"num_running_reqs": 3, "kv_usage": 0.5, "num_retractions": 2})
    series = {family.name: family.samples[0].value for family in collector.collect() if family.samples}
    assert series["radixmesh_num_running_requests"] == 3 and series["radixmesh_kv_cache_usage_ratio"] == 0.5
    assert series["radixmesh_retractions"] == 2 and series["radixmesh_num_queued_requests"] == 0


def test_fallback_reasons_are_normalised_to_the_declared_labels() -> None:
    before = {reason: sample("radixmesh_kv_transfer_fallbacks_total", {"reason": reason})
              for reason in FALLBACK_REASONS}
    metrics.observe_kv_transfer_fallback("Lease lapsed")
    metrics.observe_kv_transfer_fallback("prefill-timeout")
    metrics.observe_kv_transfer_fallback("the moon")
    after = {reason: sample("radixmesh_kv_transfer_fallbacks_total", {"reason": reason})
             for reason in FALLBACK_REASONS}
    changed = {reason: after[reason] - before[reason] for reason in FALLBACK_REASONS if after[reason] != before[reason]}
    assert changed == {"lease_lapsed": 1.0, "prefill_timeout": 1.0, "other": 1.0}


def test_kv_series_exist_for_every_registered_transport() -> None:
    from radixmesh.engine.disagg.transport.registry import KV_TRANSPORTS

    for transport in KV_TRANSPORTS.ids:
        for direction in ("send", "receive"):
            labels = {"transport": transport, "direction": direction}
            assert REGISTRY.get_sample_value("radixmesh_kv_transfer_bytes_total", labels) is not None


def test_reservations_and_transfers_are_counted() -> None:
    granted = sample("radixmesh_kv_reservations_total", {"outcome": "granted"})
    metrics.observe_reservation("granted", 0.01)
    assert sample("radixmesh_kv_reservations_total", {"outcome": "granted"}) == granted + 1
    sent = sample("radixmesh_kv_transfer_bytes_total", {"transport": "grpc", "direction": "send"})
    metrics.observe_kv_transfer("grpc", "send", 4096, 0.002)
    assert sample("radixmesh_kv_transfer_bytes_total", {"transport": "grpc", "direction": "send"}) == sent + 4096


def test_lora_series_per_adapter() -> None:
    """Every loaded adapter has a running and a waiting series (0 while idle); the names the hook reports."""
    from radixmesh.worker.service import _count_adapter

    collector = EngineStatsCollector()
    collector.update({"lora_adapters": ["sql", "chat"], "lora_running": {"sql": 2}, "lora_waiting": {"chat": 1},
                      "max_loras_per_batch": 4, "lora_slot_loads": 5})
    families = {family.name: family for family in collector.collect()}
    requests = {(s.labels["adapter"], s.labels["state"]): s.value
                for s in families["radixmesh_lora_adapter_requests"].samples}
    assert requests == {("sql", "running"): 2, ("sql", "waiting"): 0, ("chat", "running"): 0,
                        ("chat", "waiting"): 1}
    assert families["radixmesh_lora_adapters_loaded"].samples[0].value == 2
    assert families["radixmesh_lora_slot_loads"].samples[0].value == 5
    collector.update({})  # without LoRA: the families exist, with no per-adapter samples
    families = {family.name: family for family in collector.collect()}
    assert families["radixmesh_lora_adapter_requests"].samples == []
    assert families["radixmesh_lora_adapters_loaded"].samples[0].value == 0
    tokens = sample("radixmesh_lora_generation_tokens_total", {"adapter": "sql"})
    finished = sample("radixmesh_lora_requests_finished_total", {"adapter": "sql"})
    _count_adapter("sql", 3, finished=False)
    _count_adapter("sql", 1, finished=True)
    assert sample("radixmesh_lora_generation_tokens_total", {"adapter": "sql"}) == tokens + 4
    assert sample("radixmesh_lora_requests_finished_total", {"adapter": "sql"}) == finished + 1


def test_gateway_counts_tokens_per_adapter() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from radixmesh.gateway.metrics import GatewayMetrics

    gateway = GatewayMetrics("m", "gateway")
    gateway.observe_adapter("sql", 3, finished=False)
    gateway.observe_adapter("sql", 1, finished=True)
    samples = {(s.name, s.labels.get("adapter")): s.value
               for f in text_string_to_metric_families(gateway.render().decode()) for s in f.samples}
    assert samples[("radixmesh_lora_generation_tokens_total", "sql")] == 4
    assert samples[("radixmesh_lora_requests_finished_total", "sql")] == 1
    assert gateway.lora is None  # a gateway's engines are the workers: they report the adapters they hold
