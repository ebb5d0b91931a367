"""The processes of `radixmesh bench routing`: shared workers, one router + gateway per policy."""

from __future__ import annotations

import contextlib
import os
import shlex
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from radixmesh.cluster.local import HOST, router_sees_all
from radixmesh.cluster.processes import grpc_serving, http_ok, is_alive, log_tail, spawn, stop_group
from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.index.redis_server import LocalRedis, free_port
from radixmesh.protocol import common_pb2, router_pb2_grpc, sampling_pb2, worker_pb2, worker_pb2_grpc

READY_TIMEOUT_S = 600.0
LATENCY_PROMPT = list(range(1000, 1040))


class BenchCluster:
    """Redis, workers and a tokenizer, started once and stopped on exit."""

    def __init__(self, num_workers: int, model_args: list[str], worker_args: str, work_dir: Path,
                 worker_http: bool = False) -> None:
        """`worker_http`: every worker also serves its OpenAI HTTP API (`http_endpoints`), for proxies."""
        self.num_workers = num_workers
        self.model = model_args
        """The model flags of workers and tokenizer (ClusterSpec.model_args)."""
        self.worker_args = shlex.split(worker_args)
        self.log_dir = work_dir / "logs"
        self.pids: dict[str, int] = {}
        self.redis: LocalRedis | None = None
        self.workers: list[str] = []
        self.worker_http = worker_http
        self.http_endpoints: list[str] = []
        """host:port of each worker's HTTP API (with worker_http)."""
        self.tokenizer = ""
        self.tokenizer_dir: str | None = None
        """The served model's directory (for the benchmark's own tokenizer), once a gateway reported it."""
        self.startup_s = 0.0

    def __enter__(self) -> BenchCluster:
        start = time.monotonic()
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        self.startup_s = time.monotonic() - start
        return self

    def _start(self) -> None:
        self.redis = LocalRedis(free_port(HOST), self.log_dir).start()
        threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // self.num_workers))}
        self.workers = [f"{HOST}:{free_port(HOST)}" for _ in range(self.num_workers)]
        self.http_endpoints = [f"{HOST}:{free_port(HOST)}" for _ in self.workers] if self.worker_http else []
        for i, address in enumerate(self.workers):
            http = ["--http-port", self.http_endpoints[i].rsplit(":", 1)[1]] if self.worker_http else []
            self._spawn(f"worker-{i}", ["worker", "--port", address.rsplit(":", 1)[1], "--metrics-port", "-1",
                                        "--redis-url", self.redis.url, *http, *self.model, *self.worker_args], threads)
        self.tokenizer = f"{HOST}:{free_port(HOST)}"
        self._spawn("tokenizer", ["tokenizer", "--port", self.tokenizer.rsplit(":", 1)[1], "--metrics-port", "-1",
                                  *self.model])
        for i, address in enumerate(self.workers):
            self._wait(f"worker-{i}", lambda a=address: grpc_serving(a))
        self._wait("tokenizer", lambda: grpc_serving(self.tokenizer))

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.pids[name] = spawn(name, args, self.log_dir, env).pid

    def _wait(self, name: str, ready: Any) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready():
            if not is_alive(self.pids[name]) or time.monotonic() > deadline:
                raise RadixMeshError(ErrorCode.UNAVAILABLE, f"{name} did not start:\n{log_tail(self.log_dir, name)}")
            time.sleep(0.3)

    def __exit__(self, *exc: object) -> None:
        for name in reversed(list(self.pids)):
            stop_group(self.pids.pop(name), "radixmesh", timeout_s=20)
        if self.redis is not None:
            self.redis.stop()

    @contextlib.contextmanager
    def front(self, policy: str) -> Iterator[Front]:
        """A router with `policy` and a gateway before the shared workers, stopped on exit."""
        assert self.redis is not None
        router, metrics_port, gateway_port = f"{HOST}:{free_port(HOST)}", free_port(HOST), free_port(HOST)
        self._spawn(f"router-{policy}", ["router", "--port", router.rsplit(":", 1)[1], "--metrics-port",
                                         str(metrics_port), "--policy", policy, "--workers", ",".join(self.workers),
                                         "--redis-url", self.redis.url])
        front = Front(router, f"http://{HOST}:{metrics_port}", f"http://{HOST}:{gateway_port}", self.workers)
        try:
            self._wait(f"router-{policy}", lambda: router_sees_all(router, len(self.workers)))
            self._spawn(f"gateway-{policy}", ["gateway", "--port", str(gateway_port), "--router", router,
                                              "--tokenizer", self.tokenizer])
            self._wait(f"gateway-{policy}", lambda: http_ok(f"{front.gateway_url}/health"))
            if self.tokenizer_dir is None:
                from radixmesh.cluster.bench import tokenizer_dir_of_gateway

                self.tokenizer_dir = tokenizer_dir_of_gateway(front.gateway_url)
            yield front
        finally:
            for name in (f"gateway-{policy}", f"router-{policy}"):
                if name in self.pids:
                    stop_group(self.pids.pop(name), "radixmesh", timeout_s=20)
            front.close()


class Front:
    """One policy's router and gateway, and the measurements taken against them."""

    def __init__(self, router: str, metrics_url: str, gateway_url: str, workers: list[str]) -> None:
        self.router = router
        self.metrics_url = metrics_url
        self.gateway_url = gateway_url
        self._channels = {a: grpc.insecure_channel(a) for a in [router, *workers]}

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def _first_token_s(self, address: str, stub_class: Any) -> tuple[float, str]:
        request = worker_pb2.GenerateRequest(token_ids=LATENCY_PROMPT,
                                             block_hashes=common_pb2.BlockHashes(block_size=16),
                                             sampling_params=sampling_pb2.SamplingParams(max_new_tokens=1))
        start = time.perf_counter()
        first = next(iter(stub_class(self._channels[address]).Generate(request, timeout=60)))
        return time.perf_counter() - start, first.routing.worker_id or address

    def paired_latency(self, num_samples: int) -> dict[str, Any]:
        """1-token requests through the router, each paired with the same request straight to its worker."""
        self._first_token_s(self.router, router_pb2_grpc.RouterServiceStub)  # warm: the prompt gets cached
        routed, direct = [], []
        for _ in range(num_samples):
            elapsed, worker = self._first_token_s(self.router, router_pb2_grpc.RouterServiceStub)
            routed.append(elapsed)
            direct.append(self._first_token_s(worker, worker_pb2_grpc.WorkerServiceStub)[0])
        from radixmesh.cluster.bench import paired_median

        return {"routed_ttft_p50_ms": _median_ms(routed), "direct_ttft_p50_ms": _median_ms(direct),
                "routed_minus_direct_p50_ms": paired_median(routed, direct)}

    def scrape(self) -> str:
        with urllib.request.urlopen(f"{self.metrics_url}/metrics", timeout=5) as response:
            text: str = response.read().decode()
        return text

    def router_metrics(self, idle_text: str) -> dict[str, Any]:
        """Overhead and decision-time p50 while the workers were idle (the paired 1-token requests, scraped
        into `idle_text`) and under the workload (everything since), plus the decisions taken."""
        text = self.scrape()
        overhead, decision = "radixmesh_router_overhead_seconds", "radixmesh_router_decision_seconds"
        return {"router_overhead_idle_p50_ms": histogram_quantile(idle_text, overhead, 0.5) * 1e3,
                "router_overhead_p50_ms": histogram_quantile(text, overhead, 0.5, idle_text) * 1e3,
                "decision_idle_p50_ms": histogram_quantile(idle_text, decision, 0.5) * 1e3,
                "decision_p50_ms": histogram_quantile(text, decision, 0.5, idle_text) * 1e3,
                "decisions": decision_counts(text)}


def _median_ms(values: list[float]) -> float:
    import statistics

    return statistics.median(values) * 1000.0


def _buckets(text: str, name: str) -> dict[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        if family.name == name:
            return {float(s.labels["le"]): s.value for s in family.samples if s.name.endswith("_bucket")}
    return {}


def histogram_quantile(text: str, name: str, q: float, baseline: str | None = None) -> float:
    """Quantile of a Prometheus histogram (minus the counts in `baseline`, an earlier scrape), linearly
    interpolated inside its bucket as PromQL does."""
    now = _buckets(text, name)
    before = _buckets(baseline, name) if baseline is not None else {}
    buckets = sorted((le, count - before.get(le, 0.0)) for le, count in now.items())
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(count - lower_count, 1e-12)
        lower_bound, lower_count = bound, count
    return lower_bound


def decision_counts(text: str) -> dict[str, int]:
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "radixmesh_router_decisions":
            for s in family.samples:
                if s.name.endswith("_total"):
                    key = f"{s.labels['policy']}/{s.labels['reason']}"
                    counts[key] = counts.get(key, 0) + int(s.value)
    return counts
