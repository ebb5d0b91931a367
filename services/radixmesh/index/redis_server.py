"""Starts a throwaway local redis-server (for `radixmesh cluster up` and the tests)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from radixmesh.common.errors import ErrorCode, RadixMeshError


def redis_server_binary() -> str | None:
    """Path of redis-server on PATH, or None when it is not installed."""
    return shutil.which("redis-server")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class LocalRedis:
    """A redis-server child process without persistence, bound to one loopback port."""

    port: int
    """TCP port it listens on."""
    workdir: Path
    """Its working directory (log file)."""
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        binary = redis_server_binary()
        if binary is None:
            raise RadixMeshError(ErrorCode.UNAVAILABLE, "redis-server is not installed (apt-get install redis-server)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / f"redis-{self.port}.log"
        args = [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--logfile", str(log), "--protected-mode", "yes"]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not _answers_ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RadixMeshError(ErrorCode.UNAVAILABLE,
                                     f"redis-server did not start on port {self.port}; see {log}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Terminate the process (by its pid) and wait for it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False
