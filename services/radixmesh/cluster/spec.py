"""What `radixmesh cluster up` starts (ClusterSpec) and what it leaves behind (ClusterState, the state file)."""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from radixmesh.common.env import cache_dir
from radixmesh.common.errors import invalid_argument
from radixmesh.common.tls import TlsConfig
from radixmesh.engine.config import DTYPES, LOAD_FORMATS

STATE_FILE = "state.json"
TLS_FILES = ("ca.crt", "tls.crt", "tls.key")
"""What ClusterSpec.tls_dir holds: the layout of a cert-manager Secret."""
GPUS_AUTO, GPUS_NONE = "auto", "none"
"""ClusterSpec.gpus besides an explicit list of GPU ids."""


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
    num_routers: int = 1
    """Router replicas, each on its own port, all reading the same Redis; the gateway spreads over them.
    0: no router service; the gateway routes in its own process (`gateway --embedded-router`)."""
    redis_url: str | None = None
    """An existing Redis; None starts one when redis-server is installed (else no index)."""
    policy: str = "cache-aware"
    """Routing policy id."""
    model: str | None = None
    """Model for workers, tokenizer and grammar services (None: the default model)."""
    load_format: str = "auto"
    """auto | safetensors | gguf | dummy, for every service that loads the model or its tokenizer."""
    tokenizer: str | None = None
    """Tokenizer directory or hub id when it is not the model's own (None: the model's)."""
    dtype: str = "auto"
    """Weights' dtype of the workers (auto: float32 on CPU, bfloat16 on CUDA)."""
    context_length: int | None = None
    """Override of the model's context length (None: the model's)."""
    gateway_port: int = 0
    """HTTP port of the gateway (0: a free one)."""
    worker_args: str = ""
    """Extra flags for every worker (engine flags such as --max-total-tokens 8192), shell-quoted."""
    router_args: str = ""
    """Extra flags for every router (e.g. --health-interval-s 0.5), shell-quoted."""
    tokenizer_args: str = ""
    """Extra flags for the tokenizer service (e.g. --block-size 32), shell-quoted."""
    grammar_args: str = ""
    """Extra flags for the grammar service (e.g. --compile-threads 4), shell-quoted."""
    gateway_args: str = ""
    """Extra flags for the gateway (e.g. --max-queued-requests 64), shell-quoted."""
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
    tls_dir: Path | None = None
    """Directory with ca.crt, tls.crt, tls.key: mutual TLS between all services, TLS on the gateway; None: plaintext."""
    tls_server_name: str | None = None
    """Name checked in the services' certificate instead of 127.0.0.1 (--tls-server-name)."""
    gpus: str = GPUS_AUTO
    """Workers' GPUs: auto (the host's, when workers run on CUDA) | none (environment as is) | ids like 0,1."""

    def __post_init__(self) -> None:
        if min(self.num_workers, self.num_prefill_workers, self.num_decode_workers) < 0:
            raise invalid_argument("worker counts must be >= 0", "workers")
        if self.num_workers + self.num_decode_workers < 1:
            raise invalid_argument("a cluster needs at least one unified or decode worker", "workers")
        if self.num_prefill_workers and not self.num_decode_workers:
            raise invalid_argument("prefill workers need decode workers (--decode-workers)", "prefill_workers")
        if self.num_routers < 0:
            raise invalid_argument("--routers must be >= 0 (0: the gateway routes in its own process)", "routers")
        if self.load_format not in LOAD_FORMATS:
            raise invalid_argument(f"load_format must be one of {', '.join(LOAD_FORMATS)}", "load_format")
        if self.dtype not in DTYPES:
            raise invalid_argument(f"dtype must be one of {', '.join(DTYPES)}", "dtype")
        if self.context_length is not None and self.context_length < 2:
            raise invalid_argument("context_length must be >= 2", "context_length")
        if self.tls_dir is not None:
            missing = [name for name in TLS_FILES if not (self.tls_dir / name).is_file()]
            if missing:
                raise invalid_argument(f"--tls-dir {self.tls_dir} lacks {', '.join(missing)} (it needs ca.crt, "
                                       "tls.crt and tls.key, as a cert-manager Secret holds them)", "tls_dir")
            self.tls_config()  # unreadable or mismatched files fail now, naming the flag
        if self.gpus not in (GPUS_AUTO, GPUS_NONE):
            parse_gpu_ids(self.gpus)

    def tls_config(self) -> TlsConfig | None:
        """The certificates every service (and `cluster up`'s own health checks) use; None without tls_dir."""
        if self.tls_dir is None:
            return None
        return TlsConfig(cert_file=str(self.tls_dir / "tls.crt"), key_file=str(self.tls_dir / "tls.key"),
                         ca_file=str(self.tls_dir / "ca.crt"), server_name=self.tls_server_name)

    def tls_env(self) -> dict[str, str]:
        """RADIXMESH_TLS_* for every service: their --tls-* flags default to these."""
        tls = self.tls_config()
        if tls is None:
            return {}
        env = {"RADIXMESH_TLS_CERT": str(tls.cert_file), "RADIXMESH_TLS_KEY": str(tls.key_file),
               "RADIXMESH_TLS_CA": str(tls.ca_file)}
        if tls.server_name:
            env["RADIXMESH_TLS_SERVER_NAME"] = tls.server_name
        return env

    def worker_roles(self) -> list[tuple[str, str]]:
        """(process name, role) of every worker: worker-<i> (unified), prefill-<i>, decode-<i>."""
        return ([(f"worker-{i}", "unified") for i in range(self.num_workers)]
                + [(f"prefill-{i}", "prefill") for i in range(self.num_prefill_workers)]
                + [(f"decode-{i}", "decode") for i in range(self.num_decode_workers)])

    def router_names(self) -> list[str]:
        """Process names of the routers: `router` alone, or router-0 .. router-<n-1> for several."""
        if self.num_routers <= 1:
            return ["router"][:self.num_routers]
        return [f"router-{i}" for i in range(self.num_routers)]

    def model_args(self) -> list[str]:
        """The model flags (the same on every service that loads the model or its tokenizer), set ones only."""
        args = ["--model", self.model] if self.model else []
        if self.load_format != "auto":
            args += ["--load-format", self.load_format]
        if self.tokenizer:
            args += ["--tokenizer", self.tokenizer]
        if self.dtype != "auto":
            args += ["--dtype", self.dtype]
        if self.context_length is not None:
            args += ["--context-length", str(self.context_length)]
        return args

    def worker_device(self) -> str:
        """The workers' --device as worker_args set it (auto: CUDA when the host has a GPU)."""
        return _last_flag_value(shlex.split(self.worker_args), "--device") or "auto"

    def worker_tp_size(self) -> int:
        """GPUs per worker: its --tp-size as worker_args set it (1 when unset). An --ep-size there (MoE models: the
        experts spread over the worker's GPUs) must be 1 or the same number."""
        args = shlex.split(self.worker_args)
        tp_size, ep_size = _int_flag(args, "--tp-size"), _int_flag(args, "--ep-size")
        if ep_size not in (1, tp_size):
            raise invalid_argument(f"--worker-args: --ep-size {ep_size} spreads the experts over the worker's GPUs: "
                                   f"give --tp-size {ep_size} with it (EP size = GPUs per worker), or --ep-size 1",
                                   "ep_size")
        return tp_size

    def with_gpus(self, detected: Sequence[str]) -> ClusterSpec:
        """A copy with gpus=auto resolved: the `detected` GPU ids when the workers may run on CUDA, else none."""
        if self.gpus != GPUS_AUTO:
            return self
        on_gpu = bool(detected) and self.worker_device() != "cpu"
        return dataclasses.replace(self, gpus=",".join(detected) if on_gpu else GPUS_NONE)

    def gpu_ids(self) -> list[str]:
        """The selected GPU ids ([] for none); gpus=auto must be resolved first (with_gpus)."""
        assert self.gpus != GPUS_AUTO, "resolve gpus=auto with ClusterSpec.with_gpus first"
        return [] if self.gpus == GPUS_NONE else parse_gpu_ids(self.gpus)

    def worker_gpus(self) -> dict[str, list[str]]:
        """Worker process name -> its CUDA_VISIBLE_DEVICES (place_workers); {} leaves every worker's
        environment alone (gpus none, or workers on --device cpu)."""
        gpu_ids = self.gpu_ids()
        if not gpu_ids or self.worker_device() == "cpu":
            return {}
        names = [name for name, _ in self.worker_roles()]
        return dict(zip(names, place_workers(gpu_ids, [self.worker_tp_size()] * len(names))))


def parse_gpu_ids(text: str) -> list[str]:
    """The ids of a GPU list such as "0,1" (indices or UUIDs, as CUDA_VISIBLE_DEVICES takes them)."""
    ids = [part.strip() for part in text.split(",")]
    if not all(ids) or len(set(ids)) != len(ids):
        raise invalid_argument(f"--gpus takes auto, none or distinct GPU ids such as 0,1 (got {text!r})", "gpus")
    return ids


def place_workers(gpu_ids: Sequence[str], gpus_per_worker: Sequence[int]) -> list[list[str]]:
    """Each worker's CUDA_VISIBLE_DEVICES order: every GPU of `gpu_ids`, rotated so that its own come first.

    Worker w owns the next gpus_per_worker[w] GPUs round robin (consecutive ones for tensor parallelism);
    more GPUs asked for than selected means sharing. A worker uses its first visible device (its tensor-
    parallel rank r the r-th), and every worker sees all of them: cuda-ipc opens a peer's GPU memory.
    """
    assert gpu_ids, "no GPUs to place workers on"
    placements, start = [], 0
    for num_gpus in gpus_per_worker:
        if num_gpus > len(gpu_ids):
            raise invalid_argument(f"a worker with --tp-size {num_gpus} needs {num_gpus} GPUs; {len(gpu_ids)} "
                                   f"selected ({','.join(gpu_ids)})", "gpus")
        placements.append([*gpu_ids[start:], *gpu_ids[:start]])
        start = (start + num_gpus) % len(gpu_ids)
    return placements


def _int_flag(args: list[str], flag: str) -> int:
    """An integer flag's last value in `args` (1 when absent)."""
    value = _last_flag_value(args, flag) or "1"
    try:
        return max(1, int(value))
    except ValueError:
        raise invalid_argument(f"--worker-args: {flag} must be an integer (got {value!r})",
                               flag.removeprefix("--").replace("-", "_")) from None


def _last_flag_value(args: list[str], flag: str) -> str | None:
    """The value of the last `flag VALUE` or `flag=VALUE` in `args` (argparse's last one wins), else None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


@dataclass
class ClusterState:
    """What `down` needs, and what users and tests read: written to <state_dir>/state.json."""

    gateway_url: str
    router_address: str
    """The first router (every router: router_addresses); "" when the gateway routes in its own process."""
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
    router_addresses: list[str] = field(default_factory=list)
    """Every router replica, in start order (the gateway was given all of them)."""
    router_names: list[str] = field(default_factory=list)
    """Process name (key of `pids`) of each router in router_addresses: router, or router-<i> for several."""
    model_args: list[str] = field(default_factory=list)
    """The model flags every model-loading service was started with."""
    worker_gpus: dict[str, str] = field(default_factory=dict)
    """Worker process name -> the CUDA_VISIBLE_DEVICES it was started with, its own GPU(s) first (none: as is)."""

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
