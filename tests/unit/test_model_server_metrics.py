"""The model-server protocol's gauges (what inference-pool pickers scrape) on a local engine's /metrics."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixmesh.gateway.metrics import GatewayMetrics
from radixmesh.gateway.model_server_metrics import KV_USAGE, LORA_INFO, RUNNING, WAITING


def _samples(text: str) -> dict[str, tuple[dict[str, str], float]]:
    return {s.name: (s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.mark.parametrize("service", ["serve", "worker"])
def test_local_engines_export_the_gauges_pickers_read(service: str) -> None:
    metrics = GatewayMetrics("qwen", service)
    metrics.update_engine({"num_waiting_reqs": 3, "num_running_reqs": 5, "kv_usage": 0.25}, in_flight=8)
    samples = _samples(metrics.render().decode())
    for name, value in ((WAITING, 3.0), (RUNNING, 5.0), (KV_USAGE, 0.25)):
        labels, got = samples[name]
        assert got == value and labels["model_name"] == "qwen" and labels["service"] == service
    metrics.set_model_name("renamed")
    assert _samples(metrics.render().decode())[WAITING][0]["model_name"] == "renamed"


def test_a_cluster_gateway_exports_none() -> None:
    """A gateway's load sums its workers': no pool's picker should read it as one model server's."""
    metrics = GatewayMetrics("qwen", "gateway")
    metrics.update_engine({"num_waiting_reqs": 3}, in_flight=0)
    assert WAITING not in metrics.render().decode()


def test_lora_adapters_in_the_protocol_form() -> None:
    """vllm:lora_requests_info: adapters with running and with waiting requests, and the adapters per batch."""
    metrics = GatewayMetrics("base", "worker")
    metrics.update_engine({"num_waiting_reqs": 1, "max_loras_per_batch": 8, "lora_running": {"sql": 2, "chat": 1},
                           "lora_waiting": {"law": 1, "sql": 0}}, in_flight=3)
    labels, value = _samples(metrics.render().decode())[LORA_INFO]
    assert (labels["running_lora_adapters"], labels["waiting_lora_adapters"], labels["max_lora"]) == (
        "chat,sql", "law", "8")
    assert value > 0  # the time of the stats
    plain = GatewayMetrics("base", "worker")
    plain.update_engine({"num_waiting_reqs": 1}, in_flight=0)
    assert LORA_INFO not in plain.render().decode()
