"""The NIXL library behind the `nixl` KV transport: finding it, its options, and one agent per process.

NIXL ships as `nixl-cu13` (module `nixl_cu13`, the `radixmesh[nixl]` extra) or `nixl-cu12` (`nixl_cu12`), each
with UCX bundled. Only the UCX backend is used. UCX reads its own environment (`UCX_TLS`, `UCX_NET_DEVICES`,
...) when the agent is created: set them on the worker (docs/disaggregation.md lists what a cluster sets).
"""

from __future__ import annotations

import functools
import importlib
import os
import socket
import uuid
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from radixmesh.common.env import env_str
from radixmesh.common.errors import invalid_argument, unsupported

NIXL_MODULES = ("nixl_cu13", "nixl_cu12")
NIXL_EXTRA = "radixmesh[nixl]"
NIXL_MODES = ("auto", "direct", "staging")
"""How a side lays out its rows for the READ: `direct` describes the pool's rows in place (one descriptor per run
of contiguous rows and layer), `staging` packs them into a registered staging buffer first (the gather/scatter
kernels, one descriptor), `auto` stages only rows too fragmented for their descriptors to pay."""


@dataclass(frozen=True)
class NixlOptions:
    """Tuning of the nixl transport (defaults from RADIXMESH_NIXL_* variables)."""

    mode: str = "auto"
    """auto | direct | staging (see NIXL_MODES)."""
    staging_bytes: int = 0
    """Size of the registered staging buffer each side allocates once; 0: a default by device and pool size."""
    min_run_bytes: int = 0
    """auto mode: rows are staged when the descriptors of a transfer would average fewer bytes; 0: by device."""
    progress_thread: bool = True
    """NIXL's progress thread (it spins on a core, yielding). Without it the scheduler loop progresses the agent
    once per iteration: enough where READs need nothing of the exporting side (RDMA, NVLink) but its
    connection setup; over TCP the exporting side's UCX answers each READ only then."""

    def __post_init__(self) -> None:
        if self.mode not in NIXL_MODES:
            raise invalid_argument(f"nixl mode must be one of {', '.join(NIXL_MODES)} (got {self.mode!r})", "mode")
        if self.staging_bytes < 0 or self.min_run_bytes < 0:
            raise invalid_argument("nixl staging_bytes and min_run_bytes must be >= 0", "staging_bytes")

    @staticmethod
    def from_env() -> NixlOptions:
        """RADIXMESH_NIXL_MODE, RADIXMESH_NIXL_STAGING_MB, RADIXMESH_NIXL_MIN_RUN_KB and
        RADIXMESH_NIXL_PROGRESS_THREAD (0: off) (unset: defaults)."""
        try:
            return NixlOptions(mode=env_str("NIXL_MODE") or "auto",
                               staging_bytes=int(float(env_str("NIXL_STAGING_MB") or 0) * 2**20),
                               min_run_bytes=int(float(env_str("NIXL_MIN_RUN_KB") or 0) * 2**10),
                               progress_thread=(env_str("NIXL_PROGRESS_THREAD") or "1") != "0")
        except ValueError as exc:
            raise invalid_argument(f"RADIXMESH_NIXL_STAGING_MB / _MIN_RUN_KB must be numbers ({exc})",
                                   "staging_bytes") from exc

    def staging_size(self, device_type: str, pool_bytes: int) -> int:
        """Bytes of the staging buffer: the option, else 2 GiB on CUDA (256 MiB on CPU), at most half the pool."""
        if self.staging_bytes:
            return self.staging_bytes
        return min(2 * 2**30 if device_type == "cuda" else 256 * 2**20, max(pool_bytes // 2, 1 << 20))

    def min_run(self, device_type: str) -> int:
        """auto mode's threshold: on a GPU every descriptor is a copy launched by UCX (microseconds each), so
        rows are staged unless their runs average 1 MiB; host memory breaks even far lower."""
        if self.min_run_bytes:
            return self.min_run_bytes
        return 2**20 if device_type == "cuda" else 64 * 2**10


@functools.cache
def _find() -> ModuleType | None:
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def nixl_available() -> bool:
    """The NIXL library can be imported here."""
    return _find() is not None


def load_nixl() -> ModuleType:
    """The NIXL module; UNSUPPORTED naming the extra when it is not installed."""
    module = _find()
    if module is None:
        raise unsupported(f"the nixl KV transport needs the NIXL library: pip install '{NIXL_EXTRA}' (or nixl-cu12 "
                          "on CUDA 12)", "kv_transport")
    return module


def create_agent(progress_thread: bool = True) -> tuple[Any, str]:
    """A NIXL agent with the UCX backend (and a progress thread), named uniquely for this process's life (a
    restarted worker is a new agent to its peers). Returns (agent, name)."""
    nixl = load_nixl()
    name = f"radixmesh-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        agent = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))
    except Exception as exc:  # the bindings raise their own types (nixlBackendError, ...)
        raise unsupported(f"NIXL could not start its UCX backend ({type(exc).__name__}: {exc}); check the UCX_* "
                          "variables (UCX_TLS, UCX_NET_DEVICES)", "kv_transport") from exc
    if "UCX" not in agent.backends:
        raise unsupported("NIXL has no UCX plugin here (its plugin directory is incomplete)", "kv_transport")
    return agent, name


def agent_name(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
