"""A local cluster on 127.0.0.1: Redis (optional), workers (unified, or prefill and decode tiers), tokenizer,
grammar (optional), one or more routers, gateway.

`up` starts everything as background processes on free ports, waits until each answers,
and writes a state file (pids, ports, URLs); `down` stops exactly the pids in that file.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixmesh.cluster.processes import cmdline, grpc_serving, http_ok, is_alive, log_tail, spawn, stop_group
from radixmesh.cluster.spec import GPUS_AUTO, STATE_FILE, ClusterSpec, ClusterState, default_state_dir
from radixmesh.common.errors import ErrorCode, RadixMeshError, invalid_argument
from radixmesh.common.tls import configure_clients, sync_channel
from radixmesh.index.redis_server import LocalRedis, free_port, redis_server_binary

__all__ = ["HOST", "STATE_FILE", "ClusterSpec", "ClusterState", "cluster_down", "cluster_status", "cluster_up",
           "default_state_dir", "detect_gpus", "resolve_gpus", "router_sees_all"]

HOST = "127.0.0.1"

_EXPECT = {"redis": "redis-server"}
"""What each pid's command line must contain to be ours (default: radixmesh)."""


class _Starter:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.log_dir = spec.state_dir / "logs"
        self.pids: dict[str, int] = {}
        self.metrics_urls: dict[str, str] = {}

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        tracing = ["--otlp-endpoint", self.spec.otlp_endpoint] if self.spec.otlp_endpoint else []
        self.pids[name] = spawn(name, [*args, "--log-level", self.spec.log_level, *tracing], self.log_dir,
                                {**self.spec.tls_env(), **(env or {})}).pid

    def metrics_args(self, name: str) -> list[str]:
        """--metrics-port of a gRPC service: a free port (remembered) with ClusterSpec.metrics, else -1 (off)."""
        if not self.spec.metrics:
            return ["--metrics-port", "-1"]
        port = free_port(HOST)
        self.metrics_urls[name] = f"http://{HOST}:{port}/metrics"
        return ["--metrics-port", str(port)]

    def wait(self, name: str, ready: Any, what: str) -> None:
        deadline = time.monotonic() + self.spec.timeout_s
        while not ready():
            pid = self.pids[name]
            if not is_alive(pid) or time.monotonic() > deadline:
                reason = "exited" if not is_alive(pid) else f"did not answer within {self.spec.timeout_s:.0f} s"
                raise RadixMeshError(ErrorCode.UNAVAILABLE, f"{name} {reason} ({what}); last lines of its log:\n"
                                     + log_tail(self.log_dir, name))
            time.sleep(0.1)

    def stop_all(self) -> None:
        for name in reversed(list(self.pids)):
            stop_group(self.pids[name], _EXPECT.get(name, "radixmesh"), timeout_s=15)


def cluster_up(spec: ClusterSpec) -> ClusterState:
    """Start the cluster (see the module docstring); on any failure stop what was started and raise."""
    spec = resolve_gpus(spec)
    existing = ClusterState.load(spec.state_dir)
    if existing is not None and any(_alive(existing).values()):
        raise invalid_argument(f"a cluster from {spec.state_dir / STATE_FILE} is still running "
                               f"(gateway {existing.gateway_url}); run `radixmesh cluster down` first")
    starter = _Starter(spec)
    if spec.tls_dir is not None:
        configure_clients(spec.tls_config())  # this process's health checks speak mutual TLS too
    try:
        return _start_all(spec, starter)
    except BaseException:
        starter.stop_all()
        raise


def _start_all(spec: ClusterSpec, starter: _Starter) -> ClusterState:
    redis_url = spec.redis_url
    if redis_url is None and redis_server_binary() is not None:
        redis = LocalRedis(free_port(HOST), starter.log_dir).start()
        assert redis.proc is not None
        starter.pids["redis"] = redis.proc.pid
        redis_url = redis.url
    model = spec.model_args()
    index = ["--redis-url", redis_url] if redis_url else []
    named = {name: (_address(), role) for name, role in spec.worker_roles()}
    workers = [address for address, _ in named.values()]
    gpus = spec.worker_gpus()
    grammar = _start_grammar(spec, starter, model, index)
    grammar_args = ["--grammar-service", grammar] if grammar else []
    for name, (address, role) in named.items():
        starter.start(name, ["worker", *_listen(address), "--role", role, *starter.metrics_args(name), *model,
                             *index, *grammar_args, *shlex.split(spec.worker_args)],
                      env=_worker_env(len(workers), gpus.get(name)))
    tokenizer = _address()
    starter.start("tokenizer", ["tokenizer", *_listen(tokenizer), *starter.metrics_args("tokenizer"), *model,
                                *shlex.split(spec.tokenizer_args)])
    routers = {name: _address() for name in spec.router_names()}
    for name, address in routers.items():
        starter.start(name, ["router", *_listen(address), *starter.metrics_args(name), "--policy", spec.policy,
                             "--workers", ",".join(workers), *index, *shlex.split(spec.router_args)])
    # Start order does not matter (each service waits for what it needs), so the gateway starts with the rest.
    # Without router services the gateway routes itself, with the flags a router would have had.
    embedded = None if routers else shlex.join(["--policy", spec.policy, "--workers", ",".join(workers), *index,
                                                *shlex.split(spec.router_args)])
    gateway_url, gateway_ready = _start_gateway(spec, starter, list(routers.values()), tokenizer, embedded)
    if grammar:
        starter.wait("grammar", lambda: grpc_serving(grammar), f"gRPC health at {grammar}")
    for name, (address, _) in named.items():
        starter.wait(name, lambda a=address: grpc_serving(a), f"gRPC health at {address}")
    starter.wait("tokenizer", lambda: grpc_serving(tokenizer), f"gRPC health at {tokenizer}")
    for name, address in routers.items():
        starter.wait(name, lambda a=address: router_sees_all(a, len(workers)), f"all workers healthy at {address}")
    starter.wait("gateway", gateway_ready, f"GET {gateway_url}/health")
    state = ClusterState(gateway_url=gateway_url, router_address=next(iter(routers.values()), ""),
                         tokenizer_address=tokenizer, worker_addresses=workers, redis_url=redis_url,
                         policy=spec.policy, log_dir=str(starter.log_dir), pids=dict(starter.pids),
                         metrics_urls=dict(starter.metrics_urls), grammar_address=grammar,
                         worker_roles={address: role for address, role in named.values()},
                         router_addresses=list(routers.values()), router_names=list(routers), model_args=model,
                         worker_gpus={name: ",".join(ids) for name, ids in gpus.items()})
    state.save(spec.state_dir)
    return state


def _worker_env(num_workers: int, gpu_ids: list[str] | None) -> dict[str, str]:
    env = {}
    if "OMP_NUM_THREADS" not in os.environ:
        # CPU workers share the machine's cores instead of each spinning up one thread per core.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // num_workers))
    if gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    return env


def resolve_gpus(spec: ClusterSpec) -> ClusterSpec:
    """`spec` with gpus=auto resolved against this host's GPUs (detect_gpus); other values as they are."""
    return spec.with_gpus(detect_gpus()) if spec.gpus == GPUS_AUTO else spec


def detect_gpus() -> list[str]:
    """This host's GPUs as CUDA_VISIBLE_DEVICES ids, without importing torch: the ones this process's
    CUDA_VISIBLE_DEVICES names when set, else one index per GPU that `nvidia-smi -L` (or the driver's
    /proc/driver/nvidia/gpus) lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return visible_gpu_ids(visible)
    return [str(i) for i in range(_count_nvidia_gpus())]


def visible_gpu_ids(visible: str) -> list[str]:
    """The ids of a CUDA_VISIBLE_DEVICES value as CUDA reads it: up to the first empty or negative entry."""
    ids: list[str] = []
    for part in visible.split(","):
        part = part.strip()
        if not part or part.startswith("-") or part in ids:
            break
        ids.append(part)
    return ids


def _count_nvidia_gpus() -> int:
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
            return sum(1 for line in listing.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        return sum(1 for _ in Path("/proc/driver/nvidia/gpus").iterdir())
    except OSError:
        return 0


def _address() -> str:
    return f"{HOST}:{free_port(HOST)}"


def _listen(address: str) -> list[str]:
    return ["--host", HOST, "--port", address.rsplit(":", 1)[1]]


def _start_gateway(spec: ClusterSpec, starter: _Starter, routers: list[str], tokenizer: str,
                   embedded_router: str | None = None) -> tuple[str, Callable[[], bool]]:
    """Start the gateway over every router (comma-separated), or routing in its own process with
    `embedded_router`'s flags; returns its URL and a check of its /health."""
    gateway_port = spec.gateway_port or free_port(HOST)
    target = ["--router", ",".join(routers)] if embedded_router is None else ["--embedded-router", embedded_router]
    starter.start("gateway", ["gateway", "--host", HOST, "--port", str(gateway_port), *target,
                              "--tokenizer", tokenizer, *shlex.split(spec.gateway_args)])
    tls = spec.tls_config()
    gateway_url = f"{'https' if tls else 'http'}://{HOST}:{gateway_port}"
    ca_file = tls.ca_file if tls else None
    if spec.metrics:
        starter.metrics_urls["gateway"] = f"{gateway_url}/metrics"
    return gateway_url, lambda: http_ok(f"{gateway_url}/health", ca_file=ca_file)


def _start_grammar(spec: ClusterSpec, starter: _Starter, model: list[str], index: list[str]) -> str | None:
    """The grammar service's address, started (not yet waited on) when the spec asks for it."""
    if not spec.grammar:
        return None
    address = _address()
    starter.start("grammar", ["grammar", *_listen(address), *starter.metrics_args("grammar"), *model, *index,
                              *shlex.split(spec.grammar_args)])
    return address


def router_sees_all(address: str, num_workers: int) -> bool:
    import grpc

    from radixmesh.protocol import router_pb2, router_pb2_grpc

    with sync_channel(address) as channel:
        try:
            reply = router_pb2_grpc.RouterServiceStub(channel).ListWorkers(router_pb2.ListWorkersRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return sum(1 for w in reply.workers if w.healthy) == num_workers


def _alive(state: ClusterState) -> dict[str, bool]:
    return {name: is_alive(pid) and _EXPECT.get(name, "radixmesh") in cmdline(pid) for name, pid in state.pids.items()}


def cluster_status(state_dir: Path) -> tuple[ClusterState | None, dict[str, bool]]:
    state = ClusterState.load(state_dir)
    return state, (_alive(state) if state is not None else {})


def cluster_down(state_dir: Path, timeout_s: float = 30.0) -> list[str]:
    """Stop the pids of the state file (gateway first, Redis last); returns the names that were running."""
    state = ClusterState.load(state_dir)
    if state is None:
        return []
    stopped = []
    for name in reversed(list(state.pids)):
        if stop_group(state.pids[name], _EXPECT.get(name, "radixmesh"), timeout_s):
            stopped.append(name)
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    return stopped
