"""Start and stop `radixmesh <service>` processes on 127.0.0.1 for integration tests.

Each process gets a free port, logs to a file, is ready once its grpc.health.v1 says SERVING
(or, for HTTP services, once /health answers 200), and is stopped by its PID: SIGTERM, then
SIGKILL after a timeout. Services wait for what they need themselves, so several can be started
at once (`wait_ready=False`, then `wait_all_ready`) and stopped at once (`stop_all`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.ports import free_port

STARTUP_TIMEOUT_S = 600.0
POLL_S = 0.1


@dataclass
class ServiceProc:
    """One running `radixmesh` service process."""

    name: str
    address: str
    """host:port (gRPC) or base URL (HTTP)."""
    proc: subprocess.Popen[bytes]
    log_path: Path
    health_address: str = ""
    """host:port of its plaintext health port (with `health_port=True`), else ""."""
    http: bool = False
    """Ready once /health answers 200 (else: once gRPC health says SERVING)."""
    terminated: bool = False
    """SIGTERM was sent (once: a second one means "cancel in-flight calls now", and one that lands after the
    service removed its handlers ends it by the signal, exit code -15)."""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait, SIGKILL if needed; returns the exit code."""
        self.terminate()
        if self.proc.returncode is None:
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)

    def kill_group(self) -> None:
        """SIGKILL the service's process group (started with `new_session`: itself and its children) and reap it."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def terminate(self) -> None:
        """SIGTERM, if it still runs and was not sent one already."""
        if not self.terminated and self.proc.poll() is None:
            self.terminated = True
            self.proc.send_signal(signal.SIGTERM)


def stop_all(services: list[ServiceProc], timeout_s: float = 30.0) -> list[int]:
    """Stop every service (all told to stop at once, in the order given); their exit codes."""
    for service in services:
        service.terminate()
    return [service.stop(timeout_s) for service in services]


def within_visible_gpus(env: dict[str, str]) -> dict[str, str]:
    """`env` with its CUDA_VISIBLE_DEVICES read as indices into this process's own visible GPUs: a test that gives a
    service GPU "1" while the suite runs on GPUs "2,3" (CUDA_VISIBLE_DEVICES=2,3) puts it on GPU 3, not on GPU 1."""
    wanted, ours = env.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_VISIBLE_DEVICES")
    if not wanted or not ours:
        return env
    visible = [d.strip() for d in ours.split(",") if d.strip()]
    try:
        mapped = [visible[int(i)] for i in wanted.split(",")]
    except (ValueError, IndexError):
        raise ValueError(f"CUDA_VISIBLE_DEVICES={wanted!r} asks for GPUs this process does not see ({ours!r})") \
            from None
    return {**env, "CUDA_VISIBLE_DEVICES": ",".join(mapped)}


def start_service(name: str, args: list[str], http: bool = False, env: dict[str, str] | None = None,
                  health_port: bool = False, wait_ready: bool = True, port: int | None = None,
                  new_session: bool = False) -> ServiceProc:
    """`radixmesh <name> --port P <args>` (with `env` on top of ours), waited on until ready (unless not
    `wait_ready`). `health_port`: also serve plaintext health on a second port and wait on that one (the
    main port may need mutual TLS). `port`: this one rather than a free one (a restart at the same address);
    `new_session`: in a process group of its own (`kill_group` then reaches its child processes too)."""
    port = port or free_port()
    log_path = Path(tempfile.mkdtemp(prefix=f"radixmesh-{name}-")) / f"{name}.log"
    cmd = [sys.executable, "-m", "radixmesh.cli", name, "--host", "127.0.0.1", "--port", str(port), *args]
    health_address = ""
    if health_port:
        health = free_port()
        cmd += ["--health-port", str(health)]
        health_address = f"127.0.0.1:{health}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=new_session,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **within_visible_gpus(env or {})})
    address = f"http://127.0.0.1:{port}" if http else f"127.0.0.1:{port}"
    service = ServiceProc(name, address, proc, log_path, health_address, http)
    if wait_ready:
        wait_all_ready([service])
    return service


def wait_all_ready(services: list[ServiceProc]) -> None:
    """Wait until every service is ready; if one exits or times out, stop them all and raise."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    waiting = list(services)
    try:
        with httpx.Client(timeout=2) as client:
            while waiting:
                for service in list(waiting):
                    if service.proc.poll() is not None:
                        raise RuntimeError(f"radixmesh {service.name} exited with {service.proc.returncode}:\n"
                                           f"{service.log()}")
                    if _ready(client, service):
                        waiting.remove(service)
                if waiting and time.monotonic() > deadline:
                    raise RuntimeError(f"radixmesh {waiting[0].name} did not become ready:\n{waiting[0].log()}")
                if waiting:
                    time.sleep(POLL_S)
    except BaseException:
        stop_all(services, 5)
        raise


def _ready(client: httpx.Client, service: ServiceProc) -> bool:
    if not service.http:
        return grpc_serving(service.health_address or service.address)
    try:
        return client.get(service.address + "/health").status_code == 200
    except httpx.TransportError:
        return False


def grpc_serving(address: str, service: str = "") -> bool:
    """Whether grpc.health.v1 at `address` reports `service` SERVING."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=2)
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False
