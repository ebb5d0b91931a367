"""kwok's fake Nodes: created through the API with the capacity and labels the tests need; kwok (which
manages nodes annotated KWOK_ANNOTATION=fake) makes them Ready and runs their pods without containers."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

KWOK_ANNOTATION = "kwok.x-k8s.io/node"


@dataclass(frozen=True)
class FakeNode:
    """One fake node: name, labels, taints and allocatable resources."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    """Extra labels (kubernetes.io/hostname and os/arch are always set)."""
    gpus: int = 8
    """nvidia.com/gpu allocatable (the chart's workers ask for GPUs)."""
    cpu: str = "256"
    memory: str = "2Ti"
    pods: str = "512"
    taints: tuple[dict[str, str], ...] = ()

    def manifest(self) -> dict[str, Any]:
        resources = {"cpu": self.cpu, "memory": self.memory, "pods": self.pods, "nvidia.com/gpu": str(self.gpus)}
        labels = {"kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                  "type": "kwok", **self.labels}
        return {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.name, "labels": labels, "annotations": {KWOK_ANNOTATION: "fake"}},
                "spec": {"taints": list(self.taints)},
                "status": {"allocatable": resources, "capacity": resources}}


DEFAULT_NODE = FakeNode("kwok-node-0", labels={"nvidia.com/gpu.present": "true"})
"""The node every control plane starts with: room for any test's pods, GPUs included, no taints."""


def create_kwok_node(api_client: Any, node: FakeNode) -> None:
    """Create `node` (already there: left as it is)."""
    from kubernetes import client

    try:
        client.CoreV1Api(api_client).create_node(node.manifest())
    except client.ApiException as exc:
        if exc.status != 409:
            raise


def is_node_ready(node: Any) -> bool:
    conditions = node.status.conditions or [] if node.status else []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def wait_nodes_ready(api_client: Any, names: list[str], check: Callable[[], None] | None = None,
                     timeout_s: float = 30.0) -> None:
    """Until kwok has made every node in `names` Ready (`check` runs between polls and may raise)."""
    from kubernetes import client

    api = client.CoreV1Api(api_client)
    deadline = time.monotonic() + timeout_s
    waiting = list(names)
    while waiting:
        if check is not None:
            check()
        waiting = [n for n in waiting if not is_node_ready(api.read_node(n))]
        if waiting and time.monotonic() > deadline:
            raise AssertionError(f"nodes not Ready after {timeout_s:.0f} s: {waiting} (is kwok running?)")
        if waiting:
            time.sleep(0.1)
