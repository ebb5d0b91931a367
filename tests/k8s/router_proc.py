"""`radixmesh router` as the chart deploys it, run on 127.0.0.1 against the test control plane.

It takes the routing flags of the chart's own router Deployment, a kubeconfig holding a token of the chart's
own ServiceAccount (so the chart's Role is all it may use), and the pod loopback map (the discovery's test
hook: kwok pod IPs -> the loopback ports of the fake workers the test starts).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from radixmesh.protocol import router_pb2, router_pb2_grpc
from radixmesh.router.discovery.loopback_map import PodLoopbackMap
from tests.k8s.kube import wait_for
from tests.k8s.processes import Child, start
from tests.k8s.worker_proc import REPO
from tests.ports import free_port, port_free

LISTEN_FLAGS = ("--host", "--port", "--metrics-port", "--lane-port", "--log-level", "--drain-timeout-s")
"""Flags of the chart's container that say where it listens: replaced by loopback ones here."""


def chart_router_args(deployment: Any) -> list[str]:
    """The routing flags of the chart's router Deployment (its listen flags left out)."""
    args = list(deployment.spec.template.spec.containers[0].args)
    assert args[0] == "router", args
    return [a for a in args[1:] if a.split("=", 1)[0] not in LISTEN_FLAGS]


def service_account_token(api_client: Any, namespace: str, name: str) -> str:
    """A bound token of ServiceAccount `name` (TokenRequest, one hour), as the kubelet mounts one."""
    from kubernetes import client

    reply = client.CoreV1Api(api_client).create_namespaced_service_account_token(
        name, namespace, {"spec": {"expirationSeconds": 3600}})
    return str(reply.status.token)


def free_port_block(size: int = 256, low: int = 20000, high: int = 32000) -> int:
    """A base port whose next `size` ports (below Linux's ephemeral range) nothing listens on now."""
    for base in range(low + (os.getpid() % 40) * size, high - size, size):
        if all(port_free(base + i) for i in range(size)):
            return base
    raise RuntimeError(f"no block of {size} free ports in [{low}, {high})")


@dataclass
class RouterProc:
    """A running router process and a stub of its RouterService."""

    child: Child
    address: str
    channel: grpc.Channel
    stub: router_pb2_grpc.RouterServiceStub

    def workers(self) -> dict[str, router_pb2.WorkerStatus]:
        """The router's registry now: pod name -> status."""
        reply = self.stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
        return {w.worker_id: w for w in reply.workers}

    def healthy(self) -> set[str]:
        return {name for name, w in self.workers().items() if w.healthy}

    def stop(self) -> None:
        self.channel.close()
        self.child.stop()


def start_router(args: list[str], kubeconfig: Path, loopback: PodLoopbackMap, workdir: Path) -> RouterProc:
    """Start `radixmesh router ARGS` on a free loopback port with only this kubeconfig and the loopback map."""
    map_file = workdir / "pod-loopback-map.json"
    map_file.write_text(json.dumps({"pod_cidr": loopback.pod_cidr, "base_port": loopback.base_port}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}  # never "in cluster"
    env.update({"KUBECONFIG": str(kubeconfig), "RADIXMESH_TEST_POD_LOOPBACK_MAP": str(map_file),
                "PYTHONUNBUFFERED": "1"})
    port = free_port()
    child = start("router", [sys.executable, "-m", "radixmesh.cli", "router", *args, "--host=127.0.0.1",
                             f"--port={port}", "--metrics-port=-1", "--log-level=info", "--health-interval-s=0.2"],
                  workdir, env=env, cwd=REPO)
    address = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(address)
    router = RouterProc(child, address, channel, router_pb2_grpc.RouterServiceStub(channel))

    def answers() -> bool:
        if not child.running():
            raise AssertionError(f"router exited with {child.proc.returncode}:\n{child.log_tail()}")
        try:
            router.workers()
        except grpc.RpcError:
            return False
        return True

    try:
        wait_for(answers, 60, "the router to answer ListWorkers", poll_s=0.1)
    except BaseException:
        router.stop()
        raise
    return router
