"""The cluster under test: started with `cluster_up`, its processes killed, paused and restarted
with their own command lines, its workers' KV slots and every process's RSS read.

Restarted processes keep their name, port and flags; `pids` always holds the live ones, and
`close` stops exactly those.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc

from radixmesh.cluster.local import HOST, cluster_up, router_sees_all
from radixmesh.cluster.processes import grpc_serving, http_ok, is_alive, spawn, stop_group, stop_groups
from radixmesh.cluster.spec import ClusterSpec, ClusterState
from radixmesh.index.redis_server import LocalRedis, free_port
from radixmesh.protocol import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

POLL_S = 0.1
READY_TIMEOUT_S = 300.0


class FaultCluster:
    """A `cluster up` cluster (plus, on demand, a router and gateway that reach one worker through a proxy)."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.state: ClusterState | None = None
        self.pids: dict[str, int] = {}
        self.argv: dict[str, list[str]] = {}
        """name -> its `radixmesh` arguments (for a restart)."""
        self.env: dict[str, dict[str, str]] = {}
        self.addresses: dict[str, str] = {}
        """worker/router/tokenizer name -> host:port."""
        self.startup_s = 0.0

    @property
    def log_dir(self) -> Path:
        return self.spec.state_dir / "logs"

    @property
    def gateway_url(self) -> str:
        assert self.state is not None
        return self.state.gateway_url

    def __enter__(self) -> FaultCluster:
        start = time.monotonic()
        self.state = cluster_up(self.spec)
        self.startup_s = time.monotonic() - start
        self.pids = dict(self.state.pids)
        for name, pid in self.pids.items():
            if name != "redis":
                self.argv[name] = _argv(pid)[3:]  # after `python -m radixmesh.cli`
                self.env[name] = _omp_env(pid)
        workers = [n for n in self.pids if n.startswith(("worker", "prefill", "decode"))]
        self.addresses.update(zip(workers, self.state.worker_addresses))
        self.addresses.update(zip(self.state.router_names, self.state.router_addresses))
        self.addresses["tokenizer"] = self.state.tokenizer_address
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process at once (the load has ended: no order is needed)."""
        groups = [(pid, "redis-server" if name == "redis" else "radixmesh") for name, pid in self.pids.items()]
        self.pids.clear()
        stop_groups(groups, timeout_s=15)

    # ---- names ---------------------------------------------------------------------------------
    @property
    def worker_names(self) -> list[str]:
        return [n for n in self.addresses if n.startswith(("worker", "prefill", "decode"))]

    @property
    def router_names(self) -> list[str]:
        return [n for n in self.addresses if n.startswith("router")]

    # ---- faults --------------------------------------------------------------------------------
    def signal_group(self, name: str, sig: signal.Signals) -> None:
        """Send `sig` to the service's whole process group (a worker and its scheduler process)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pids[name], sig)
        if sig == signal.SIGKILL:
            deadline = time.monotonic() + 10
            while is_alive(self.pids[name]) and time.monotonic() < deadline:
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(self.pids[name], os.WNOHANG)
                time.sleep(POLL_S)

    def restart(self, name: str) -> None:
        """Start `name` again with its own flags (same port) and wait until it answers."""
        if name == "redis":
            self._restart_redis()
            return
        self.pids[name] = spawn(name, self.argv[name], self.log_dir, self.env.get(name)).pid
        wait_for(lambda: self.answers(name), READY_TIMEOUT_S, f"{name} to answer after its restart")

    def drain_restart(self, name: str, timeout_s: float = 120.0) -> float:
        """A rollout step: SIGTERM the service's main process (as Kubernetes does: it drains), wait for it to exit,
        start it again with its flags and port, and wait until it answers and every router routes to it again.
        Returns the seconds the drain took."""
        start = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pids[name], signal.SIGTERM)
        wait_for(lambda: not _running(self.pids[name]), timeout_s, f"{name} to drain and exit")
        drained_s = time.monotonic() - start
        self.restart(name)
        if name in self.worker_names:
            wait_for(lambda: all(self.answers(r) for r in self.router_names), READY_TIMEOUT_S,
                     f"every router to route to {name} again")
        return drained_s

    def _restart_redis(self) -> None:
        assert self.state is not None and self.state.redis_url is not None
        port = int(self.state.redis_url.rsplit(":", 1)[1].split("/", 1)[0])
        redis = LocalRedis(port, self.log_dir).start()
        assert redis.proc is not None
        self.pids["redis"] = redis.proc.pid

    def answers(self, name: str) -> bool:
        if name == "gateway":
            return http_ok(f"{self.gateway_url}/health")
        if name.startswith("router"):
            return router_sees_all(self.addresses[name], len(self.worker_names))
        if name == "redis":
            return is_alive(self.pids["redis"])
        return grpc_serving(self.addresses[name])

    # ---- probes --------------------------------------------------------------------------------
    def router_health(self, router: str, timeout_s: float = 1.0) -> dict[str, bool] | None:
        """worker address -> healthy, as `router` sees them (None when it does not answer)."""
        with grpc.insecure_channel(self.addresses[router]) as channel:
            try:
                reply = router_pb2_grpc.RouterServiceStub(channel).ListWorkers(router_pb2.ListWorkersRequest(),
                                                                              timeout=timeout_s)
            except grpc.RpcError:
                return None
        return {w.address: w.healthy for w in reply.workers}

    def busiest_worker(self) -> str:
        """The worker running the most requests now (the one a fault there hurts most)."""
        return max(self.worker_names, key=lambda n: self.worker_load(n).load.num_running_reqs)

    def router_policies(self) -> list[str]:
        """The policy each answering router uses now (cache-aware falls back to approx-tree without Redis)."""
        policies = []
        for router in self.router_names:
            with grpc.insecure_channel(self.addresses[router]) as channel, contextlib.suppress(grpc.RpcError):
                reply = router_pb2_grpc.RouterServiceStub(channel).ListWorkers(router_pb2.ListWorkersRequest(),
                                                                              timeout=1.0)
                policies.append(reply.policy)
        return policies

    def any_router_marks_down(self, address: str) -> bool:
        views = [self.router_health(r) for r in self.router_names]
        return any(v is not None and v.get(address) is False for v in views)

    def router_migrations(self) -> dict[str, float]:
        """radixmesh_router_migrations_total by reason, summed over the routers' /metrics ({} with metrics off)."""
        from prometheus_client.parser import text_string_to_metric_families

        assert self.state is not None
        totals: dict[str, float] = {}
        for router in self.router_names:
            url = self.state.metrics_urls.get(router)
            if url is None:
                continue
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    text = response.read().decode()
            except OSError:
                continue
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "radixmesh_router_migrations_total":
                        reason = sample.labels.get("reason", "")
                        totals[reason] = totals.get(reason, 0.0) + sample.value
        return totals

    def all_healthy(self) -> bool:
        """Every service answers and every router sees every worker healthy."""
        return (http_ok(f"{self.gateway_url}/health")
                and all(self.answers(r) for r in self.router_names)
                and grpc_serving(self.addresses["tokenizer"]))

    def worker_load(self, name: str, timeout_s: float = 10.0) -> worker_pb2.GetLoadResponse:
        with grpc.insecure_channel(self.addresses[name]) as channel:
            reply: worker_pb2.GetLoadResponse = worker_pb2_grpc.WorkerServiceStub(channel).GetLoad(
                worker_pb2.GetLoadRequest(), timeout=timeout_s)
        return reply

    def settled_kv(self, timeout_s: float = 120.0) -> dict[str, int]:
        """Once no worker runs or queues a request: flush each cache, then the KV slots still in use."""
        def idle() -> bool:
            loads = [self.worker_load(n).load for n in self.worker_names]
            return all(x.num_running_reqs == 0 and x.num_waiting_reqs == 0 for x in loads)

        wait_for(idle, timeout_s, "every worker to have no running or queued request")
        used = {}
        for name in self.worker_names:
            with grpc.insecure_channel(self.addresses[name]) as channel:
                stub = worker_pb2_grpc.WorkerServiceStub(channel)
                wait_for(lambda s=stub: s.FlushCache(worker_pb2.FlushCacheRequest(), timeout=10).flushed,
                         30, f"{name} to flush its cache")
            used[name] = int(self.worker_load(name).load.kv_used_tokens)
        return used

    def rss_mb(self) -> dict[str, float]:
        """Resident memory of every service (its whole process group), MiB."""
        groups = _process_groups()
        return {name: round(sum(_rss_kb(p) for p in groups.get(pid, [pid])) / 1024, 1)
                for name, pid in self.pids.items()}

    # ---- a front that reaches one worker through a proxy ---------------------------------------
    def start_proxied_front(self, proxied: str, proxy_address: str) -> tuple[str, str]:
        """A router (round-robin) over every worker, `proxied` dialled at `proxy_address`, and a gateway
        before it; returns (gateway URL, router name)."""
        assert self.state is not None
        workers = [proxy_address if n == proxied else self.addresses[n] for n in self.worker_names]
        router = f"{HOST}:{free_port(HOST)}"
        index = ["--redis-url", self.state.redis_url] if self.state.redis_url else []
        # the proxy forwards the worker's gRPC port only: Generate goes there too, not around it on the lane
        self._start("router-proxied", ["router", "--host", HOST, "--port", router.rsplit(":", 1)[1],
                                       "--metrics-port", "-1", "--policy", "round-robin", "--generate-transport",
                                       "grpc", "--workers", ",".join(workers), *index])
        self.addresses["router-proxied"] = router
        wait_for(lambda: router_sees_all(router, len(workers)), READY_TIMEOUT_S, "the proxied router")
        port = free_port(HOST)
        self._start("gateway-proxied", ["gateway", "--host", HOST, "--port", str(port), "--router", router,
                                        "--tokenizer", self.addresses["tokenizer"]])
        url = f"http://{HOST}:{port}"
        wait_for(lambda: http_ok(f"{url}/health"), READY_TIMEOUT_S, "the proxied gateway")
        return url, "router-proxied"

    def stop_proxied_front(self) -> None:
        for name in ("gateway-proxied", "router-proxied"):
            if name in self.pids:
                stop_group(self.pids.pop(name), "radixmesh", timeout_s=15)
        self.addresses.pop("router-proxied", None)

    def _start(self, name: str, args: list[str]) -> None:
        assert self.state is not None
        self.pids[name] = spawn(name, [*args, "--log-level", "warning"], self.log_dir).pid
        self.argv[name] = args


def wait_for(check: Any, timeout_s: float, what: str) -> float:
    """Poll `check` (exceptions count as False) until true; returns the seconds it took."""
    start = time.monotonic()
    while True:
        with contextlib.suppress(Exception):
            if check():
                return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)


def _argv(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0")
    return [a.decode() for a in raw.split(b"\0")]


def _running(pid: int) -> bool:
    """Alive and not yet reaped (a child of this process is reaped here once it exited)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
    return is_alive(pid)


def _omp_env(pid: int) -> dict[str, str]:
    """What a restart must keep of the process's environment: its threads and its GPUs."""
    try:
        items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)
    return {k: v for k, v in pairs if k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")}


def _process_groups() -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                groups.setdefault(int(fields[2]), []).append(int(entry.name))
    return groups


def _rss_kb(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0
