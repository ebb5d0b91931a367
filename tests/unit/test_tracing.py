"""Tracing configuration, off and on, the route span's attributes, and the process labels on metrics.

"On" runs in a child process (a tracer provider is global and set once per process) exporting to an
OTLP/gRPC receiver in this test; "off" checks that nothing of the SDK is loaded or called.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from radixmesh.common import tracing
from radixmesh.common.metrics import GRAMMAR_COMPILE_BUCKETS_S, BucketCounts, LabelledRegistry, histogram_from_stats
from radixmesh.router.policies.base import RoutingDecision
from radixmesh.router.route_span import route_attributes
from radixmesh.wire.messages import TokenOut
from radixmesh.worker import metrics as worker_metrics
from radixmesh.worker.timeline import RequestTimeline
from tests.otlp_receiver import OtlpReceiver
from tests.unit.router_factory import make_registry, make_request, set_load

ROOT = Path(__file__).resolve().parents[2]
OTEL_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED",
             "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _run(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in OTEL_VARS}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env={**clean, **env},
                          capture_output=True, text=True, timeout=120)


# ---- configuration -------------------------------------------------------------------------------
def test_resolve_flag_env_and_switches(clean_env: pytest.MonkeyPatch) -> None:
    assert tracing.TracingConfig.resolve("router").endpoint is None
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert tracing.TracingConfig.resolve("router").endpoint == "http://collector:4317"
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317")
    assert tracing.TracingConfig.resolve("router").endpoint == "http://traces:4317"
    assert tracing.TracingConfig.resolve("router", "10.0.0.1:4317").endpoint == "http://10.0.0.1:4317"
    clean_env.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing.TracingConfig.resolve("router", "10.0.0.1:4317").endpoint is None
    clean_env.delenv("OTEL_TRACES_EXPORTER")
    clean_env.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.TracingConfig.resolve("router", "10.0.0.1:4317").endpoint is None
    assert tracing.TracingConfig.resolve("worker").service_name == "radixmesh-worker"
    clean_env.setenv("OTEL_SERVICE_NAME", "edge")
    assert tracing.TracingConfig.resolve("worker").service_name == "edge"


def test_cli_flag_on_every_service() -> None:
    from radixmesh.cluster import commands as cluster_commands
    from radixmesh.gateway import commands as gateway_commands
    from radixmesh.grammar_service import commands as grammar_commands
    from radixmesh.router import commands as router_commands
    from radixmesh.tokenizer_service import commands as tokenizer_commands
    from radixmesh.worker import commands as worker_commands

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    for module in (gateway_commands, router_commands, tokenizer_commands, worker_commands, grammar_commands,
                   cluster_commands):
        module.register(sub)
    for argv in (["serve"], ["gateway", "--router", "r:1", "--tokenizer", "t:1"], ["router"], ["tokenizer"],
                 ["worker"], ["grammar"], ["cluster", "up"]):
        args = parser.parse_args([*argv, "--otlp-endpoint", "collector:4317"])
        assert args.otlp_endpoint == "collector:4317", argv
        assert parser.parse_args(argv).otlp_endpoint is None, argv


# ---- off ---------------------------------------------------------------------------------------------
OFF_SCRIPT = """
import asyncio, sys
import opentelemetry.trace as api
from opentelemetry import propagate

def refuse(*args, **kwargs):
    raise AssertionError("a tracing call was made with tracing off")

api.get_tracer = refuse
api.ProxyTracerProvider.get_tracer = refuse
api.ProxyTracer.start_span = refuse
api.ProxyTracer.start_as_current_span = refuse
propagate.extract = refuse

from fastapi.testclient import TestClient
from radixmesh.common import tracing
from radixmesh.wire.messages import TokenOut
from radixmesh.gateway.app import create_app
from radixmesh.gateway.config import GatewayConfig
from radixmesh.router.dispatch import RequestRouter
from radixmesh.router.policies import create_policy
from radixmesh.engine.tokenize_pool import Encoded, traced
from radixmesh.worker.timeline import RequestTimeline, record_kv_transfer, record_kv_transfer_span
from tests.unit.router_factory import make_config, make_registry, make_request
from tests.unit.test_gateway_api import FakeBackend

assert tracing.configure("gateway") is False and not tracing.enabled()
assert isinstance(api.get_tracer_provider(), api.ProxyTracerProvider)
api.get_tracer_provider = refuse  # FastAPI's own telemetry asks for it per request unless turned off
assert tracing.server_interceptors() == [] and tracing.client_interceptors() is None
channel = object()
assert tracing.instrument_channel(channel) is channel
app = create_app(FakeBackend(), GatewayConfig())
assert not any("Tracing" in m.cls.__name__ for m in app.user_middleware), app.user_middleware
with TestClient(app) as http:
    reply = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                      headers={"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"})
    assert reply.status_code == 200, reply.text
config = make_config()
router = RequestRouter(config, make_registry(2), create_policy("round-robin", config))
decision = asyncio.run(router.select(make_request(1, 2)))
timeline = RequestTimeline("r", 4)
timeline.on_output(TokenOut("r", [1], 4, 0, 1, admitted_at=1.0))
timeline.on_output(TokenOut("r", [2], 4, 0, 2, finish_reason="length", admitted_at=1.0))
timeline.close()
with tracing.span("x") as span:
    assert span is None
tracing.set_attributes({"a": 1})
record_kv_transfer("grpc", "send", 1024, 1.0, 1.5)
record_kv_transfer_span("worker.kv_reserve", 1.0, 1.1, "grpc", 0)
async def _encoded():
    return Encoded([1, 2], "hi", 0.0, 0.0, None)
assert asyncio.run(traced("serve.tokenize", "text", _encoded())).ids == [1, 2]
# redis-py imports opentelemetry.sdk.metrics on its own; no tracer SDK, exporter or instrumentation is loaded
loaded = sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exporter",
                                                          "opentelemetry.instrumentation")))
assert not loaded, loaded
print("OFF-OK")
"""


def test_off_by_default_creates_nothing_and_calls_nothing() -> None:
    """No endpoint: no provider, exporter or interceptor; the gateway, router and worker paths make no
    tracing call at all (the API's entry points are replaced by ones that fail)."""
    result = _run(OFF_SCRIPT, {})
    assert "OFF-OK" in result.stdout, result.stdout + result.stderr


def test_off_in_this_process(clean_env: pytest.MonkeyPatch) -> None:
    from opentelemetry import trace

    assert tracing.configure("router") is False
    assert not tracing.enabled()
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert not trace.get_tracer("x").start_span("y").is_recording()


# ---- on ----------------------------------------------------------------------------------------------
ON_SCRIPT = """
import sys, time
from radixmesh.common import tracing
from radixmesh.worker.timeline import record_kv_transfer

assert tracing.configure("probe", sys.argv[1] if len(sys.argv) > 1 else None, {"radixmesh.role": "unified"})
assert tracing.enabled() and tracing.server_interceptors() and tracing.client_interceptors()
with tracing.span("outer", {"a": 1}) as outer:
    start = tracing.epoch_ns()
    tracing.record_span("inner", start, start + 1000, {"b": "x"})
    tracing.set_attributes({"c": 2})
    now = time.time()
    record_kv_transfer("grpc", "receive", 4096, now - 0.25, now, attributes={"radixmesh.request_id": "r1"})
    import asyncio
    from radixmesh.engine.tokenize_pool import Encoded, traced
    async def _encoded():
        return Encoded([1, 2, 3], "hi", 0.0015, 0.002, [7, 8])
    assert asyncio.run(traced("gateway.tokenize", "chat", _encoded(), {"tokenize.block_size": 2})).extra == [7, 8]
tracing.shutdown()
print("ON-OK")
"""


@pytest.mark.parametrize("service_name", [None, "edge"])
def test_on_exports_over_otlp(service_name: str | None) -> None:
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
        if service_name:
            env["OTEL_SERVICE_NAME"] = service_name
        result = _run(ON_SCRIPT, env)
        assert "ON-OK" in result.stdout, result.stdout + result.stderr
        spans = {s.name: s for s in receiver.wait_for(lambda spans: len(spans) >= 4, 10)}
    assert set(spans) == {"outer", "inner", "worker.kv_transfer", "gateway.tokenize"}
    assert spans["gateway.tokenize"].attributes == {  # a pool encode's span (tokenize_pool.traced)
        "tokenize.input": "chat", "tokenize.block_size": 2, "tokenize.prompt_tokens": 3, "tokenize.num_blocks": 2,
        "tokenize.queued_ms": 1.5, "tokenize.encode_ms": 2.0}
    assert spans["gateway.tokenize"].parent_span_id == spans["outer"].span_id
    outer, inner, transfer = spans["outer"], spans["inner"], spans["worker.kv_transfer"]
    assert inner.trace_id == outer.trace_id and inner.parent_span_id == outer.span_id
    assert transfer.trace_id == outer.trace_id and transfer.parent_span_id == outer.span_id
    assert outer.service == (service_name or "radixmesh-probe")
    assert outer.resource["radixmesh.service"] == "probe" and outer.resource["radixmesh.role"] == "unified"
    assert outer.attributes == {"a": 1, "c": 2} and inner.attributes == {"b": "x"}
    assert inner.end_ns - inner.start_ns == 1000
    assert transfer.attributes == {"kv.transport": "grpc", "kv.bytes": 4096, "kv.direction": "receive",
                                   "radixmesh.request_id": "r1"}
    assert 0.24e9 < transfer.end_ns - transfer.start_ns < 0.26e9


GATEWAY_SCRIPT = """
from fastapi.testclient import TestClient
from radixmesh.common import tracing
from radixmesh.gateway.app import create_app
from radixmesh.gateway.config import GatewayConfig
from tests.unit.test_gateway_api import FakeBackend

assert tracing.configure("gateway")
with TestClient(create_app(FakeBackend(), GatewayConfig())) as http:
    assert http.get("/health").status_code == 200
    reply = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                      headers={"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"})
    assert reply.status_code == 200, reply.text
tracing.shutdown()
print("GATEWAY-OK")
"""


def test_gateway_traces_one_http_span_per_request_under_the_clients() -> None:
    """One SERVER span per request, child of the client's traceparent, carrying the request id; FastAPI's
    own telemetry adds no second one, and /health (probed every few seconds) is not traced."""
    with OtlpReceiver() as receiver:
        result = _run(GATEWAY_SCRIPT, {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint})
        assert "GATEWAY-OK" in result.stdout, result.stdout + result.stderr
        spans = receiver.wait_for(lambda spans: len(spans) >= 1, 10)
    assert [s.name for s in spans] == ["POST /v1/completions"], spans
    http = spans[0]
    assert http.trace_id == "ab" * 16 and http.parent_span_id == "cd" * 8 and http.kind == 2  # SERVER
    assert http.attributes["http.response.status_code"] == 200 and http.attributes["http.route"] == "/v1/completions"
    assert http.attributes["radixmesh.endpoint"] == "completions" and http.attributes["radixmesh.request_id"]


# ---- what the spans and metrics record -------------------------------------------------------------
def test_route_attributes_name_every_candidate_with_its_cache_and_load() -> None:
    registry = make_registry(3)
    workers = registry.all()
    for i, worker in enumerate(workers):
        set_load(worker, num_running_reqs=i, num_waiting_reqs=2 * i, kv_used_tokens=100 * i)
    workers[2].num_inflight = 5
    decision = RoutingDecision(workers[1], "cache-aware", "cache-hit", scores={w.worker_id: 0.5 for w in workers},
                               cached_tokens={"w1": 12}, cached_blocks=3)
    attrs = route_attributes(make_request(1, 4, rid="req-1"), decision, workers)
    assert attrs["routing.policy"] == "cache-aware" and attrs["routing.worker_id"] == "w1"
    assert attrs["routing.reason"] == "cache-hit" and attrs["routing.num_candidates"] == 3
    assert attrs["routing.attempt"] == 1
    assert route_attributes(make_request(1, 4), decision, workers, attempt=2)["routing.attempt"] == 2
    assert attrs["radixmesh.request_id"] == "req-1" and attrs["routing.cached_blocks"] == 3
    for i, worker in enumerate(workers):
        prefix = f"routing.candidate.{worker.worker_id}"
        assert attrs[f"{prefix}.cached_tokens"] == (12 if i == 1 else 0)
        assert attrs[f"{prefix}.num_running_reqs"] == i and attrs[f"{prefix}.num_waiting_reqs"] == 2 * i
        assert attrs[f"{prefix}.score"] == 0.5
    assert attrs["routing.candidate.w2.num_inflight"] == 5
    assert all(isinstance(v, str | int | float) for v in attrs.values())


def _count(histogram: object) -> float:
    samples = [s for m in histogram.collect() for s in m.samples if s.name.endswith("_count")]  # type: ignore[attr-defined]
    return samples[0].value


def test_timeline_observes_queue_time_and_inter_token_latency() -> None:
    queue, itl = _count(worker_metrics.QUEUE_TIME), _count(worker_metrics.ITL)
    timeline = RequestTimeline("r", 5)
    admitted = timeline.arrival_ns / 1e9 + 0.002
    timeline.on_output(TokenOut("r", [1], 5, 4, 1, admitted_at=admitted))
    timeline.on_output(TokenOut("r", [2, 3], 5, 4, 3, admitted_at=admitted))
    timeline.on_output(TokenOut("r", [4], 5, 4, 4, finish_reason="stop", admitted_at=admitted))
    timeline.close()
    assert _count(worker_metrics.QUEUE_TIME) == queue + 1
    assert _count(worker_metrics.ITL) == itl + 3  # two tokens together count as two gaps
    assert timeline.finish_reason == "stop" and timeline.cached_tokens == 4 and timeline.num_output_tokens == 4
    assert timeline.admitted_ns is not None and timeline.admitted_ns - timeline.arrival_ns >= 1_000_000


def test_labelled_registry_adds_process_labels_and_keeps_sample_labels() -> None:
    registry = CollectorRegistry()
    counter = Counter("radixmesh_things", "x", ["worker"], registry=registry)
    counter.labels("w7").inc(2)
    text = generate_latest(LabelledRegistry(registry, {"service": "router", "worker": "self"})).decode()
    assert 'radixmesh_things_total{service="router",worker="w7"} 2.0' in text


def test_bucket_counts_become_the_same_histogram_as_prometheus_client() -> None:
    """What the scheduler sends as plain numbers is scraped as the histogram a Histogram would give."""
    buckets = GRAMMAR_COMPILE_BUCKETS_S
    values = [0.003, 0.02, 0.02, 0.7, 45.0]
    counts = BucketCounts(buckets)
    registry = CollectorRegistry()
    reference = Histogram("radixmesh_x_seconds", "x", buckets=buckets, registry=registry)
    for value in values:
        counts.observe(value)
        reference.observe(value)
    rebuilt = histogram_from_stats("radixmesh_x_seconds", "x", buckets, counts.stats("x"), "x")
    expected = {(s.name, s.labels.get("le")): s.value for m in registry.collect() for s in m.samples
                if not s.name.endswith("_created")}
    assert {(s.name, s.labels.get("le")): s.value for s in rebuilt.samples} == pytest.approx(expected)
    empty = histogram_from_stats("radixmesh_x_seconds", "x", buckets, {}, "x")
    assert all(s.value == 0 for s in empty.samples)


def test_kv_transfer_series_exist_before_any_transfer() -> None:
    text = generate_latest(worker_metrics.REGISTRY).decode()
    for transport in ("grpc", "cuda-ipc"):
        for direction in ("send", "receive"):
            assert f'radixmesh_kv_transfer_bytes_total{{direction="{direction}",transport="{transport}"}}' in text
    before = worker_metrics.KV_TRANSFER_FALLBACKS.labels("lease_lapsed")._value.get()
    worker_metrics.observe_kv_transfer_fallback("lease lapsed")
    worker_metrics.observe_kv_transfer_fallback("something new")
    assert worker_metrics.KV_TRANSFER_FALLBACKS.labels("lease_lapsed")._value.get() == before + 1
    assert 'radixmesh_kv_transfer_fallbacks_total{reason="other"}' in generate_latest(worker_metrics.REGISTRY).decode()


@pytest.mark.parametrize("service", ["gateway", "serve"])
def test_gateway_and_serve_metrics_are_the_documented_ones(service: str) -> None:
    """The HTTP tier's registry holds exactly the doc's metrics for its service, with their types (the
    cluster test scrapes the gateway; nothing else runs `radixmesh serve` with its queue-time series)."""
    from prometheus_client.parser import text_string_to_metric_families

    from radixmesh.gateway.metrics import GatewayMetrics
    from tests.observability_doc import documented_metrics

    text = GatewayMetrics("m", service).render().decode()
    exposed = {f.name: f.type for f in text_string_to_metric_families(text)
               if f.name.startswith("radixmesh_") and not f.name.endswith("_created")}  # _created: a timestamp
    documented = {m.family: m.type for m in documented_metrics() if service in m.services}
    assert exposed == documented
    assert f'service="{service}"' in text
