"""Traces and metrics of a real local cluster: gateway, tokenizer, router, one worker (the default model on
CPU) and the grammar service, every process exporting spans to an OTLP/gRPC receiver in this test and
serving Prometheus metrics on its own port.

One cluster for the module; its metrics are first scraped before any request, so the metric test sees
every series move from that baseline.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from radixmesh.cluster.local import ClusterSpec, ClusterState, cluster_down, cluster_up
from tests.integration.service_procs import start_service
from tests.observability_doc import DocMetric, documented_metrics
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLIENT_TRACE_ID = "5e" * 16
CLIENT_SPAN_ID = "c1" * 8
PROMPT = "The three primary colors are"
MAX_TOKENS = 6
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
HTTP_SPAN = "POST /v1/completions"
TOKENIZE = "/radixmesh.v1.TokenizerService/Tokenize"
DETOKENIZE = "/radixmesh.v1.TokenizerService/Detokenize"
ROUTER_GENERATE = "/radixmesh.v1.RouterService/Generate"
WORKER_GENERATE = "/radixmesh.v1.WorkerService/Generate"
SERVER_KIND = 2
PHASES = ("tokenize", "queue", "prefill", "decode", "detokenize")
TRACING_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "200"}
"""Each process exports its finished spans within 0.2 s (the default batch delay is 5 s)."""
TRACING_OFF_ENV = ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME")
"""Variables of the test's own environment that would change what the services export."""

Families = dict[str, Metric]


@dataclass
class ObservedCluster:
    state: ClusterState
    receiver: OtlpReceiver
    baseline: dict[str, Families]
    """service -> its metric families before any request."""


def scrape(url: str) -> Families:
    response = httpx.get(url, timeout=30)
    assert response.status_code == 200, f"{url}: {response.status_code}"
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def scrape_all(state: ClusterState) -> dict[str, Families]:
    """Metric families by service (worker-0 -> worker)."""
    return {name.split("-")[0]: scrape(url) for name, url in state.metrics_urls.items()}


@pytest.fixture(scope="module")
def observed(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObservedCluster]:
    state_dir = tmp_path_factory.mktemp("observed-cluster")
    with _tracing_env(), OtlpReceiver() as receiver:
        spec = ClusterSpec(num_workers=1, redis_url="", policy="cache-aware", state_dir=state_dir,
                           worker_args="--max-total-tokens 2048", router_args="--health-interval-s 0.5",
                           log_level="info", timeout_s=300, otlp_endpoint=receiver.endpoint, metrics=True,
                           grammar=True, gateway_args="--detokenize service --tokenize service")
        # The gateway tokenizes and detokenizes through the tokenizer service here (its default is a local copy):
        # the trace then has both ends of every hop, and every documented metric moves.
        state = cluster_up(spec)
        try:
            yield ObservedCluster(state, receiver, scrape_all(state))
        finally:
            cluster_down(state_dir, timeout_s=20)


@contextlib.contextmanager
def _tracing_env() -> Iterator[None]:
    """This process's environment, which the services inherit, set for prompt export (and restored)."""
    saved = {name: os.environ.get(name) for name in (*TRACING_ENV, *TRACING_OFF_ENV)}
    for name in TRACING_OFF_ENV:
        os.environ.pop(name, None)
    os.environ.update(TRACING_ENV)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ---- radixmesh serve (first: it runs before the cluster starts) ------------------------------------
def test_serve_traces_the_engine_phases_under_the_http_span(default_model_dir: Path) -> None:
    """`radixmesh serve` (no gRPC): the HTTP span under the client's, and tokenize, queue, prefill, decode and
    detokenize as its children; its queue-time metric moves."""
    with _tracing_env(), OtlpReceiver() as receiver:
        serve = start_service("serve", ["--otlp-endpoint", receiver.endpoint, "--max-total-tokens", "2048"],
                              http=True)
        try:
            body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
            response = httpx.post(f"{serve.address}/v1/completions", json=body, timeout=120,
                                  headers={"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"})
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            families = scrape(f"{serve.address}/metrics")
            assert _total(families["radixmesh_queue_time_seconds"]) == 1
            spans = _trace(receiver.wait_for(
                lambda spans: {"serve.detokenize", HTTP_SPAN} <= {s.name for s in _trace(spans)}, timeout_s=30))
        finally:
            serve.stop()
    by_name = {s.name: s for s in spans}
    assert sorted(by_name) == sorted([HTTP_SPAN, *(f"serve.{p}" for p in PHASES)]), sorted(by_name)
    http = by_name[HTTP_SPAN]
    assert http.parent_span_id == CLIENT_SPAN_ID and http.service == "radixmesh-serve"
    phases = [by_name[f"serve.{p}"] for p in PHASES]
    assert all(s.parent_span_id == http.span_id for s in phases)
    tokenize, queue, prefill, decode, detokenize = phases
    assert tokenize.attributes["tokenize.prompt_tokens"] == usage["prompt_tokens"] == http.attributes[
        "radixmesh.prompt_tokens"]
    assert prefill.attributes["prefill.prompt_tokens"] == usage["prompt_tokens"]
    assert decode.attributes["decode.output_tokens"] == usage["completion_tokens"] == \
        detokenize.attributes["detokenize.output_tokens"]
    assert tokenize.end_ns <= queue.start_ns <= queue.end_ns <= prefill.start_ns <= decode.start_ns <= http.end_ns


# ---- one request, one trace --------------------------------------------------------------------------
def _trace(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    return [s for s in spans if s.trace_id == CLIENT_TRACE_ID]


def _trace_complete(spans: list[ReceivedSpan]) -> bool:
    """The trace's last spans arrived: the worker's decode phase, both ends of the Detokenize stream, and
    every parent but the client's (processes export in batches, so a parent may come after its child)."""
    trace = _trace(spans)
    names = [(s.service, s.name) for s in trace]
    ids = {s.span_id for s in trace} | {CLIENT_SPAN_ID}
    return all(key in names for key in [("radixmesh-worker", "worker.decode"), ("radixmesh-tokenizer", DETOKENIZE),
                                         ("radixmesh-gateway", DETOKENIZE), ("radixmesh-gateway", HTTP_SPAN)]) and all(
        s.parent_span_id in ids for s in trace if s.parent_span_id)


def _streamed_completion(gateway_url: str) -> str:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    headers = {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"}
    with httpx.stream("POST", f"{gateway_url}/v1/completions", json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        return "".join(response.iter_text())


def test_one_request_is_one_trace_across_the_services(observed: ObservedCluster) -> None:
    """Gateway HTTP span (child of the client's traceparent) -> tokenize -> route -> worker queue, prefill,
    decode -> detokenize: one trace, every span's parent in it, spans from every process, their attributes."""
    events = _streamed_completion(observed.state.gateway_url)
    assert events.rstrip().endswith("data: [DONE]"), events
    spans = _trace(observed.receiver.wait_for(_trace_complete, timeout_s=60))
    assert _trace_complete(spans), sorted((s.service, s.name) for s in spans)
    by_id = {s.span_id: s for s in spans}
    roots = [s for s in spans if s.parent_span_id not in by_id]
    assert [(r.service, r.name, r.parent_span_id) for r in roots] == [
        ("radixmesh-gateway", HTTP_SPAN, CLIENT_SPAN_ID)], "exactly one root, the gateway's, under the client's span"
    http = roots[0]
    assert http.kind == SERVER_KIND and http.attributes["http.response.status_code"] == 200
    assert {s.service for s in spans} >= {"radixmesh-gateway", "radixmesh-tokenizer", "radixmesh-router",
                                          "radixmesh-worker"}

    def one(service: str, name: str) -> ReceivedSpan:
        found = [s for s in spans if s.service == f"radixmesh-{service}" and s.name == name]
        assert len(found) == 1, (service, name, found)
        return found[0]

    def path(span: ReceivedSpan) -> list[tuple[str, str]]:
        """(service, name) of each ancestor, nearest first."""
        out = []
        while span.parent_span_id in by_id:
            span = by_id[span.parent_span_id]
            out.append((span.service.removeprefix("radixmesh-"), span.name))
        return out

    tokenize, detokenize = one("tokenizer", TOKENIZE), one("tokenizer", DETOKENIZE)
    route = one("router", "router.route")
    queue, prefill, decode = (one("worker", f"worker.{phase}") for phase in ("queue", "prefill", "decode"))
    top = ("gateway", HTTP_SPAN)
    assert path(tokenize) == [("gateway", TOKENIZE), top]
    assert path(detokenize) == [("gateway", DETOKENIZE), top]
    assert path(route) == [("router", ROUTER_GENERATE), ("gateway", ROUTER_GENERATE), top]
    to_worker = [("worker", WORKER_GENERATE), ("router", WORKER_GENERATE), ("router", ROUTER_GENERATE),
                 ("gateway", ROUTER_GENERATE), top]
    assert path(queue) == path(prefill) == path(decode) == to_worker

    num_prompt = tokenize.attributes["tokenize.prompt_tokens"]
    assert num_prompt > 0 and tokenize.attributes["tokenize.input"] == "text"
    assert http.attributes["radixmesh.prompt_tokens"] == num_prompt
    request_id = http.attributes["radixmesh.request_id"]
    assert route.attributes["radixmesh.request_id"] == request_id == decode.attributes["radixmesh.request_id"]
    assert detokenize.attributes["radixmesh.request_id"] == request_id

    worker_id = observed.state.worker_addresses[0]
    assert route.attributes["routing.policy"] in ("cache-aware", "approx-tree")  # approx-tree: no Redis here
    assert route.attributes["routing.worker_id"] == worker_id and route.attributes["routing.num_candidates"] == 1
    assert route.attributes["routing.attempt"] == 1 and route.attributes["routing.prompt_tokens"] == num_prompt
    for key in ("cached_tokens", "score", "num_running_reqs", "num_waiting_reqs", "kv_usage", "num_inflight"):
        assert f"routing.candidate.{worker_id}.{key}" in route.attributes, key

    assert prefill.attributes["prefill.prompt_tokens"] == num_prompt
    assert prefill.attributes["prefill.cached_tokens"] + prefill.attributes["prefill.computed_tokens"] == num_prompt
    num_output = decode.attributes["decode.output_tokens"]
    assert 1 <= num_output <= MAX_TOKENS
    assert decode.attributes["decode.finish_reason"] == ("length" if num_output == MAX_TOKENS else "stop")
    assert detokenize.attributes["detokenize.output_tokens"] == num_output
    for span in (queue, prefill, decode):
        assert span.resource["radixmesh.role"] == "unified" and span.attributes["radixmesh.worker_id"] == worker_id
    # one clock on one machine: the phases follow each other inside the HTTP span
    assert http.start_ns <= tokenize.start_ns < route.start_ns < queue.start_ns <= queue.end_ns
    assert queue.end_ns <= prefill.start_ns <= prefill.end_ns <= decode.start_ns <= decode.end_ns <= http.end_ns


# ---- metrics ----------------------------------------------------------------------------------------------
def _chat(gateway_url: str, **extra: Any) -> None:
    body = {"messages": [{"role": "user", "content": "Name a person and their age."}], "max_tokens": 8,
            "temperature": 0, **extra}
    response = httpx.post(f"{gateway_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text


def _load(gateway_url: str) -> None:
    """A short load that moves every `always` and `structured` series: a prompt twice (a prefix-cache hit),
    a streamed chat, and one JSON schema twice (compiled by the grammar service, then a worker cache hit)."""
    for _ in range(2):
        response = httpx.post(f"{gateway_url}/v1/completions", timeout=120,
                              json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
    _chat(gateway_url, stream=True)
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for _ in range(2):
        _chat(gateway_url, response_format=schema)


def _total(family: Metric) -> float:
    """What moves: a counter's sum over its series, a histogram's observation count."""
    suffix = "_count" if family.type == "histogram" else "_total"
    return sum(s.value for s in family.samples if s.name.endswith(suffix))


def _problems(metric: DocMetric, service: str, before: Families, after: Families) -> list[str]:
    family = after.get(metric.family)
    where = f"{metric.name} on {service}"
    if family is None:
        return [f"{where}: not exposed"]
    if family.type != metric.type:
        return [f"{where}: a {family.type}, the doc says {metric.type}"]
    if not metric.labels and not family.samples:
        return [f"{where}: no sample"]
    for sample in family.samples:
        extra = set(sample.labels) - {"service", "role", "worker", "le", *metric.labels}
        if extra:
            return [f"{where}: labels {sorted(extra)} are not in the doc"]
        if sample.labels.get("service") != service:
            return [f"{where}: sample labelled service={sample.labels.get('service')!r}"]
    if metric.moves in ("always", "structured"):
        old = before.get(metric.family)
        if _total(family) <= (_total(old) if old is not None else 0.0):
            return [f"{where}: did not move under load ({_total(family)})"]
    return []


def test_every_documented_metric_exists_and_moves(observed: ObservedCluster) -> None:
    """Each metric of docs/observability.md on each of its services' /metrics, with the documented type and
    labels; the `always` and `structured` ones grew under a short load."""
    documented = documented_metrics()
    running = set(observed.baseline)
    assert running == {"gateway", "tokenizer", "router", "worker", "grammar"}, running
    checked = [(m, service) for m in documented for service in m.services if service in running]
    assert {service for _, service in checked} == running
    _load(observed.state.gateway_url)
    deadline = time.monotonic() + 20  # the worker's engine series refresh every second
    while True:
        after = scrape_all(observed.state)
        problems = [p for m, service in checked
                    for p in _problems(m, service, observed.baseline[service], after[service])]
        if not problems or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not problems, "\n".join(problems)
    worker = after["worker"]
    labels = next(s.labels for s in worker["radixmesh_requests_finished"].samples)
    assert labels["role"] == "unified" and labels["worker"] == observed.state.worker_addresses[0]
