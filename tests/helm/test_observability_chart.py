"""The chart's observability objects, rendered with a real helm: the OpenTelemetry collector (and every
radixmesh container pointed at it), the Grafana dashboard ConfigMap, and the dashboard's queries
against the metric list of docs/observability.md."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.observability_doc import documented_metrics, series_metric

from .chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    component_of,
    container,
    of_kind,
    render,
    render_notes,
)

pytestmark = pytest.mark.helm

COLLECTOR = f"{RELEASE}-radixmesh-otel-collector"
DASHBOARD = f"{RELEASE}-radixmesh-dashboard"
EXAMPLE = CHART / "examples" / "observability.yaml"
RADIXMESH_COMPONENTS = {"gateway", "router", "tokenizer", "grammar", "worker"}
REQUIRED_PANELS_METRICS = {
    "radixmesh_time_to_first_token_seconds", "radixmesh_inter_token_latency_seconds",
    "radixmesh_e2e_request_latency_seconds", "radixmesh_queue_time_seconds", "radixmesh_num_running_requests",
    "radixmesh_num_queued_requests", "radixmesh_kv_cache_usage_ratio", "radixmesh_cache_hit_rate",
    "radixmesh_router_decisions_total", "radixmesh_router_requests_total", "radixmesh_router_retries_total",
    "radixmesh_router_circuit_state", "radixmesh_kv_transfer_bytes_total", "radixmesh_kv_transfer_seconds",
    "radixmesh_kv_transfer_fallbacks_total", "radixmesh_grammar_compile_seconds",
    "radixmesh_grammar_cache_hits_total", "radixmesh_grammar_compile_requests_total",
    "radixmesh_lora_adapter_requests", "radixmesh_lora_generation_tokens_total",
    "radixmesh_lora_requests_finished_total", "radixmesh_router_lora_decisions_total",
    "radixmesh_router_lora_loads_total",
}
"""What the dashboard must chart: the quantities DESIGN.md section 8 and the issue name."""


def _radixmesh_containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: container(d) for d in of_kind(docs, "Deployment").values()
            if component_of(d) in RADIXMESH_COMPONENTS}


def _env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def _dashboard(docs: list[dict[str, Any]]) -> dict[str, Any]:
    configmap = of_kind(docs, "ConfigMap")[DASHBOARD]
    assert list(configmap["data"]) == ["radixmesh.json"]
    dashboard: dict[str, Any] = json.loads(configmap["data"]["radixmesh.json"])
    return dashboard


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert panels and all(p.get("targets") for p in panels), "every panel queries something"
    return [t["expr"] for p in panels for t in p["targets"]]


def test_off_by_default(helm: str) -> None:
    docs = render(helm)
    names = {d["metadata"]["name"] for d in docs}
    assert COLLECTOR not in names and DASHBOARD not in names
    for name, c in _radixmesh_containers(docs).items():
        assert not [e for e in _env(c) if e.startswith("OTEL_")], f"{name}: tracing is off by default"


def test_collector_receives_from_every_radixmesh_container(helm: str) -> None:
    docs = render(helm, [EXAMPLE])
    config_map = of_kind(docs, "ConfigMap")[COLLECTOR]
    config = yaml.safe_load(config_map["data"]["collector.yaml"])
    service = of_kind(docs, "Service")[COLLECTOR]
    port = service["spec"]["ports"][0]
    assert port["name"] == "otlp-grpc" and port["appProtocol"] == "grpc"
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == f"0.0.0.0:{port['port']}"
    assert set(config["exporters"]) == {"otlp/tempo"}, "the example replaces the default debug exporter"
    assert config["exporters"]["otlp/tempo"]["endpoint"] == "tempo-distributor.tracing:4317"
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"] and pipeline["exporters"] == ["otlp/tempo"]
    assert set(pipeline["processors"]) <= set(config["processors"])
    collector = of_kind(docs, "Deployment")[COLLECTOR]
    pod = collector["spec"]["template"]["spec"]
    mount = next(m for m in container(collector)["volumeMounts"] if m["name"] == "config")
    assert f"--config={mount['mountPath']}/collector.yaml" in container(collector)["args"]
    assert {"name": "config", "configMap": {"name": COLLECTOR}} in pod["volumes"]
    assert pod["automountServiceAccountToken"] is False
    endpoint = f"http://{COLLECTOR}:{port['port']}"
    containers = _radixmesh_containers(docs)
    assert {component_of(d) for d in of_kind(docs, "Deployment").values()} >= RADIXMESH_COMPONENTS
    for name, c in containers.items():
        env = _env(c)
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint, name
        assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio" and env["OTEL_TRACES_SAMPLER_ARG"] == "0.2"
        assert env["OTEL_RESOURCE_ATTRIBUTES"] == \
            f"k8s.namespace.name={NAMESPACE},k8s.pod.name=$(OTEL_K8S_POD_NAME)", name
        names = [e["name"] for e in c["env"]]
        assert names.index("OTEL_K8S_POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES"), "defined before use"
    policy = of_kind(docs, "NetworkPolicy")[COLLECTOR]["spec"]["ingress"]
    assert len(policy) == 1 and policy[0]["ports"] == [{"port": port["port"], "protocol": "TCP"}]
    senders = {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in policy[0]["from"]}
    assert senders == RADIXMESH_COMPONENTS


def test_external_endpoint_wins_and_needs_no_collector(helm: str) -> None:
    docs = render(helm, sets=["tracing.otlpEndpoint=otel.observability:4317"])
    assert COLLECTOR not in {d["metadata"]["name"] for d in docs}
    for name, c in _radixmesh_containers(docs).items():
        env = _env(c)
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "otel.observability:4317", name
        assert env["OTEL_TRACES_SAMPLER"] == "parentbased_always_on" and "OTEL_TRACES_SAMPLER_ARG" not in env
    both = render(helm, sets=["tracing.otlpEndpoint=otel.observability:4317", "otelCollector.enabled=true"])
    assert all(_env(c)["OTEL_EXPORTER_OTLP_ENDPOINT"] == "otel.observability:4317"
               for c in _radixmesh_containers(both).values())


def test_default_collector_logs_spans(helm: str) -> None:
    docs = render(helm, sets=["otelCollector.enabled=true"])
    config = yaml.safe_load(of_kind(docs, "ConfigMap")[COLLECTOR]["data"]["collector.yaml"])
    assert config["exporters"] == {"debug": {"verbosity": "basic"}}
    assert config["service"]["pipelines"]["traces"]["exporters"] == ["debug"]


def test_dashboard_configmap_for_the_grafana_sidecar(helm: str) -> None:
    docs = render(helm, sets=["grafana.dashboards.enabled=true"])
    configmap = of_kind(docs, "ConfigMap")[DASHBOARD]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == NAMESPACE
    dashboard = _dashboard(docs)
    assert dashboard["title"] == "radixmesh" and dashboard["uid"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    example = of_kind(render(helm, [EXAMPLE]), "ConfigMap")[DASHBOARD]["metadata"]
    assert example["namespace"] == "monitoring" and example["annotations"] == {"grafana_folder": "radixmesh"}
    relabelled = render(helm, sets=["grafana.dashboards.enabled=true", "grafana.dashboards.labels.dashboards=radixmesh",
                                    "grafana.dashboards.labels.grafana_dashboard=null"])
    labels = of_kind(relabelled, "ConfigMap")[DASHBOARD]["metadata"]["labels"]
    assert labels["dashboards"] == "radixmesh" and "grafana_dashboard" not in labels


def test_dashboard_queries_only_documented_metrics(helm: str) -> None:
    """Every series a panel queries is in docs/observability.md (a histogram through _bucket/_sum/_count), and
    the panels cover what the observability design asks for."""
    documented = {m.name: m for m in documented_metrics()}
    queried = set()
    for expr in _exprs(_dashboard(render(helm, sets=["grafana.dashboards.enabled=true"]))):
        for series in re.findall(r"\b(radixmesh_[a-z0-9_]+)", expr):
            metric = series_metric(series, documented)
            assert metric is not None, f"{series} (in {expr!r}) is not in docs/observability.md"
            if metric.type == "histogram":
                assert series.endswith("_bucket") == ("histogram_quantile" in expr), expr
            queried.add(metric.name)
    assert queried >= REQUIRED_PANELS_METRICS, sorted(REQUIRED_PANELS_METRICS - queried)


def test_lora_row_charts_each_adapter(helm: str) -> None:
    """The LoRA row's panels: each adapter's requests, tokens, finished sequences, holders and placements."""
    panels = _dashboard(render(helm, sets=["grafana.dashboards.enabled=true"]))["panels"]
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == "LoRA adapters")
    row = panels[start + 1:]
    row = row[:next((i for i, p in enumerate(row) if p["type"] == "row"), len(row))]
    assert len(row) >= 5
    per_adapter = [p["title"] for p in row if any("by (adapter" in t["expr"] for t in p["targets"])]
    assert len(per_adapter) == len(row), [p["title"] for p in row]
    assert all("{{adapter}}" in t["legendFormat"] for p in row for t in p["targets"] if "by (adapter" in t["expr"])
    bottoms = [p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels[:start]]
    assert panels[start]["gridPos"]["y"] >= max(bottoms)  # below everything before it


def test_notes_say_where_traces_and_the_dashboard_go(helm: str, tmp_path: Path) -> None:
    notes = render_notes(helm, tmp_path, sets=["otelCollector.enabled=true", "grafana.dashboards.enabled=true"])
    assert f"spans to http://{COLLECTOR}:4317" in notes and "exporting to debug" in notes
    assert f"kubectl -n {NAMESPACE} logs deploy/{COLLECTOR}" in notes
    assert f"ConfigMap {DASHBOARD} (namespace {NAMESPACE})" in notes and 'grafana_dashboard="1"' in notes
    assert "Traces:" not in render_notes(helm, tmp_path) and "Grafana:" not in render_notes(helm, tmp_path)
