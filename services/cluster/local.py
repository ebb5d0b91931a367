"""A local cluster on 127.0.0.1: Redis (optional), workers (unified, or prefill and decode tiers), tokenizer,
router, gateway.

`up` starts everything as background processes on free ports, waits until each answers,
and writes a state file (pids, ports, URLs); `down` stops exactly the pids in that file.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from radixmesh.cluster.processes import cmdline, grpc_serving, http_ok, is_alive, log_tail, spawn, stop_group
from radixmesh.common.env import cache_dir
from radixmesh.common.errors import ErrorCode, RadixMeshError, invalid_argument
from radixmesh.index.redis_server import LocalRedis, free_port, redis_server_binary

HOST = "127.0.0.1"
STATE_FILE = "state.json"


def default_state_dir() -> Path:
    return cache_dir() / "cluster"


@dataclass(frozen=True)
class ClusterSpec:
    """What `radixmesh cluster up` starts."""

    num_workers: int = 2
    """Unified workers."""
    num_prefill_workers: int = 0
    """Disaggregation: prefill workers (they need decode workers)."""
    num_decode_workers: int = 0
    """Disaggregation: decode workers (without prefill workers they compute prompts themselves)."""
    redis_url: str | None = None
    """An existing Redis; None starts one when redis-server is installed (else no index)."""
    policy: str = "cache-aware"
    """Routing policy id."""
    model: str | None = None
    """Model for workers and tokenizer (None: the default model)."""
    gateway_port: int = 0
    """HTTP port of the gateway (0: a free one)."""
    worker_args: str = ""
    """Extra flags for every worker (engine flags such as --max-total-tokens 8192), shell-quoted."""
    router_args: str = ""
    """Extra flags for the router (e.g. --health-interval-s 0.5), shell-quoted."""
    log_level: str = "warning"
    """Logging level of every service."""
    state_dir: Path = field(default_factory=default_state_dir)
    """Where the state file and the logs go."""
    timeout_s: float = 600.0
    """How long `up` waits for every service to answer."""
    otlp_endpoint: str | None = None
    """OTLP/gRPC endpoint every service sends its spans to; None: $OTEL_EXPORTER_OTLP_*, else tracing off."""
    metrics: bool = False
    """Serve each service's Prometheus metrics on a free port (listed in the state file); off: none."""
    grammar: bool = False
    """Start the grammar service too; workers fetch compiled grammars from it."""

    def __post_init__(self) -> None:
        if min(self.num_workers, self.num_prefill_workers, self.num_decode_workers) < 0:
            raise invalid_argument("worker counts must be >= 0", "workers")
        if self.num_workers + self.num_decode_workers < 1:
            raise invalid_argument("a cluster needs at least one unified or decode worker", "workers")
        if self.num_prefill_workers and not self.num_decode_workers:
            raise invalid_argument("prefill workers need decode workers (--decode-workers)", "prefill_workers")

    def worker_roles(self) -> list[tuple[str, str]]:
        """(process name, role) of every worker: worker-<i> (unified), prefill-<i>, decode-<i>."""
        return ([(f"worker-{i}", "unified") for i in range(self.num_workers)]
                + [(f"prefill-{i}", "prefill") for i in range(self.num_prefill_workers)]
                + [(f"decode-{i}", "decode") for i in range(self.num_decode_workers)])


@dataclass
class ClusterState:
    """What `down` needs, and what users and tests read: written to <state_dir>/state.json."""

    gateway_url: str
    router_address: str
    tokenizer_address: str
    worker_addresses: list[str]
    redis_url: str | None
    policy: str
    log_dir: str
    pids: dict[str, int] = field(default_factory=dict)
    """service name -> pid (each the leader of its own process group)."""
    metrics_urls: dict[str, str] = field(default_factory=dict)
    """service name -> its Prometheus /metrics URL (with ClusterSpec.metrics)."""
    grammar_address: str | None = None
    """The grammar service (with ClusterSpec.grammar)."""
    worker_roles: dict[str, str] = field(default_factory=dict)
    """worker address -> unified | prefill | decode."""

    def save(self, state_dir: Path) -> Path:
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / STATE_FILE
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, state_dir: Path) -> ClusterState | None:
        path = state_dir / STATE_FILE
        if not path.is_file():
            return None
        data: dict[str, Any] = json.loads(path.read_text())
        return cls(**data)


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
        self.pids[name] = spawn(name, [*args, "--log-level", self.spec.log_level, *tracing], self.log_dir, env).pid

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
            time.sleep(0.3)

    def stop_all(self) -> None:
        for name in reversed(list(self.pids)):
            stop_group(self.pids[name], _EXPECT.get(name, "radixmesh"), timeout_s=15)


def cluster_up(spec: ClusterSpec) -> ClusterState:
    """Start the cluster (see the module docstring); on any failure stop what was started and raise."""
    existing = ClusterState.load(spec.state_dir)
    if existing is not None and any(_alive(existing).values()):
        raise invalid_argument(f"a cluster from {spec.state_dir / STATE_FILE} is still running "
                               f"(gateway {existing.gateway_url}); run `radixmesh cluster down` first")
    starter = _Starter(spec)
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
    model = ["--model", spec.model] if spec.model else []
    index = ["--redis-url", redis_url] if redis_url else []
    named = {name: (f"{HOST}:{free_port(HOST)}", role) for name, role in spec.worker_roles()}
    workers = [address for address, _ in named.values()]
    # CPU workers share the machine's cores instead of each spinning up one thread per core.
    threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // len(workers)))}
    grammar = _start_grammar(spec, starter, model, index)
    grammar_args = ["--grammar-service", grammar] if grammar else []
    for name, (address, role) in named.items():
        starter.start(name, ["worker", "--host", HOST, "--port", address.rsplit(":", 1)[1], "--role", role,
                             *starter.metrics_args(name), *model, *index, *grammar_args,
                             *shlex.split(spec.worker_args)],
                      env=threads if "OMP_NUM_THREADS" not in os.environ else None)
    tokenizer = f"{HOST}:{free_port(HOST)}"
    starter.start("tokenizer", ["tokenizer", "--host", HOST, "--port", tokenizer.rsplit(":", 1)[1],
                                *starter.metrics_args("tokenizer"), *model])
    router = f"{HOST}:{free_port(HOST)}"
    starter.start("router", ["router", "--host", HOST, "--port", router.rsplit(":", 1)[1],
                             *starter.metrics_args("router"), "--policy", spec.policy, "--workers", ",".join(workers),
                             *index, *shlex.split(spec.router_args)])
    if grammar:
        starter.wait("grammar", lambda: grpc_serving(grammar), f"gRPC health at {grammar}")
    for name, (address, _) in named.items():
        starter.wait(name, lambda a=address: grpc_serving(a), f"gRPC health at {address}")
    starter.wait("tokenizer", lambda: grpc_serving(tokenizer), f"gRPC health at {tokenizer}")
    starter.wait("router", lambda: router_sees_all(router, len(workers)), f"all workers healthy at {router}")
    gateway_port = spec.gateway_port or free_port(HOST)
    starter.start("gateway", ["gateway", "--host", HOST, "--port", str(gateway_port), "--router", router,
                              "--tokenizer", tokenizer])
    gateway_url = f"http://{HOST}:{gateway_port}"
    starter.wait("gateway", lambda: http_ok(f"{gateway_url}/health"), f"GET {gateway_url}/health")
    if spec.metrics:
        starter.metrics_urls["gateway"] = f"{gateway_url}/metrics"
    state = ClusterState(gateway_url=gateway_url, router_address=router, tokenizer_address=tokenizer,
                         worker_addresses=workers, redis_url=redis_url, policy=spec.policy,
                         log_dir=str(starter.log_dir), pids=dict(starter.pids),
                         metrics_urls=dict(starter.metrics_urls), grammar_address=grammar,
                         worker_roles={address: role for address, role in named.values()})
    state.save(spec.state_dir)
    return state


def _start_grammar(spec: ClusterSpec, starter: _Starter, model: list[str], index: list[str]) -> str | None:
    """The grammar service's address, started (not yet waited on) when the spec asks for it."""
    if not spec.grammar:
        return None
    address = f"{HOST}:{free_port(HOST)}"
    starter.start("grammar", ["grammar", "--host", HOST, "--port", address.rsplit(":", 1)[1],
                              *starter.metrics_args("grammar"), *model, *index])
    return address


def router_sees_all(address: str, num_workers: int) -> bool:
    import grpc

    from radixmesh.protocol import router_pb2, router_pb2_grpc

    with grpc.insecure_channel(address) as channel:
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
