"""Child processes the k8s tests start: logged to files, stopped by PID (SIGTERM, then SIGKILL), and ended
by the kernel if the test process dies first (PR_SET_PDEATHSIG), so nothing outlives a killed run."""

from __future__ import annotations

import ctypes
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


@dataclass
class Child:
    """One started process and its log."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-num_chars:]
        except OSError as exc:
            return f"(no log: {exc})"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM this PID, SIGKILL it after timeout_s; returns once it has exited."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout_s)


def start(name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> Child:
    """Start `argv` with stdout and stderr in log_dir/<name>.log."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=cwd, preexec_fn=_die_with_parent)
    return Child(name, proc, log)
