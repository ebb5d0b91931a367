"""A fake worker (tests/fake_worker.py: the WorkerService API, scripted answers, no model) as its own
process, standing in for one kwok pod's container on a loopback port.

    python -m tests.k8s.worker_proc --port P --name POD     serves until SIGTERM; prints READY once it listens
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.k8s.processes import Child, start

READY_LINE = "READY"
REPO = Path(__file__).resolve().parents[2]


async def serve(name: str, port: int) -> None:
    from tests.fake_worker import FakeWorker

    worker = await FakeWorker(name, port=port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"{READY_LINE} {worker.address}", flush=True)
    await stop.wait()
    await worker.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.name, args.port))
    return 0


@dataclass
class WorkerProc:
    """A started fake worker process: the pod it stands for and its loopback address."""

    pod: str
    address: str
    child: Child

    def stop(self) -> None:
        self.child.stop()


def start_worker(pod: str, port: int, log_dir: Path, timeout_s: float = 30.0) -> WorkerProc:
    """Start a fake worker for `pod` on 127.0.0.1:`port` and wait until it listens."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = start(f"worker-{pod}", [sys.executable, "-m", "tests.k8s.worker_proc", "--port", str(port),
                                    "--name", pod], log_dir, env=env, cwd=REPO)
    deadline = time.monotonic() + timeout_s
    while READY_LINE not in child.log_tail():
        if not child.running() or time.monotonic() > deadline:
            child.stop()
            raise RuntimeError(f"fake worker for {pod} on port {port} did not start:\n{child.log_tail()}")
        time.sleep(0.05)
    return WorkerProc(pod, f"127.0.0.1:{port}", child)


def stop_workers(workers: list[WorkerProc]) -> None:
    for worker in workers:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            worker.stop()


if __name__ == "__main__":
    raise SystemExit(main())
