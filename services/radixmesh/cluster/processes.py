"""Starting, probing and stopping the background processes of a local cluster.

Every service runs in its own session (process group), so stopping one also stops the
processes it started itself (a worker's scheduler process), and only those.
"""

from __future__ import annotations

import contextlib
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixmesh.common.tls import sync_channel

POLL_S = 0.2


def spawn(name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`radixmesh <args>` in the background (extra `env` on top of ours), output to <log_dir>/<name>.log."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{name}.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "radixmesh.cli", *args], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})


def grpc_serving(address: str, timeout_s: float = 1.0) -> bool:
    """grpc.health.v1 says SERVING for the server as a whole (asked over mutual TLS when this process has it)."""
    with sync_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def http_ok(url: str, timeout_s: float = 1.0, ca_file: str | None = None) -> bool:
    """GET `url` answers 200 (an https URL checked against `ca_file` when given)."""
    context = ssl.create_default_context(cafile=ca_file) if ca_file else None
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    return True


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def stop_group(pid: int, expect: str, timeout_s: float = 30.0) -> bool:
    """SIGTERM the process group led by `pid` (if `pid` still runs `expect`), SIGKILL it after the timeout.

    Returns False when there was nothing of ours to stop.
    """
    return bool(stop_groups([(pid, expect)], timeout_s))


def stop_groups(groups: list[tuple[int, str]], timeout_s: float = 30.0) -> list[int]:
    """`stop_group` of every (pid, expect) at once: all are sent SIGTERM, then waited on together (for
    processes that need no order, such as those of a finished benchmark). Returns the pids that were ours."""
    ours = [pid for pid, expect in groups if is_alive(pid) and expect in cmdline(pid)]
    for pid in ours:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(is_alive(pid) for pid in ours) and time.monotonic() < deadline:
        for pid in ours:
            _reap(pid)
        time.sleep(POLL_S)
    for pid in ours:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # the leader, if it hung, and anything left in its group
        _reap(pid)
    return ours


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def log_tail(log_dir: Path, name: str, num_lines: int = 15) -> str:
    path = log_dir / f"{name}.log"
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(lines[-num_lines:])
