"""How a worker pod (the API's JSON form) becomes a `WorkerEndpoint`, or is not one yet.

A pod counts as a worker only while it is Running, Ready, not being deleted and has an IP:
the Kubernetes endpoints controller uses the same rule, so the router and a Service agree.
"""

from __future__ import annotations

import logging
from typing import Any

from radixmesh.router.discovery.base import WORKER_ROLES, WorkerEndpoint

ROLE_LABEL = "radixmesh.io/role"
"""Pod label naming the worker's role (unified | prefill | decode); missing means unified."""
GRPC_PORT_ANNOTATION = "radixmesh.io/grpc-port"
"""Pod annotation with the worker's gRPC port."""
METRICS_PORT_ANNOTATION = "radixmesh.io/metrics-port"
"""Pod annotation with the worker's Prometheus port (optional)."""
DEFAULT_GRPC_PORT = 50051
"""gRPC port assumed when a pod has no port annotation."""

logger = logging.getLogger(__name__)


def pod_name(pod: dict[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("name", ""))


def is_pod_ready(pod: dict[str, Any]) -> bool:
    """Running, condition Ready=True, no deletion timestamp and an IP."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if metadata.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    conditions = status.get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def endpoint_from_pod(pod: dict[str, Any]) -> WorkerEndpoint | None:
    """The worker a pod stands for, or None while it is not ready or is misconfigured (logged)."""
    if not is_pod_ready(pod):
        return None
    metadata = pod.get("metadata") or {}
    name = pod_name(pod)
    labels = dict(metadata.get("labels") or {})
    annotations = metadata.get("annotations") or {}
    role = labels.get(ROLE_LABEL, "unified")
    if role not in WORKER_ROLES:
        logger.warning("pod %s: label %s=%r is not one of %s; ignored", name, ROLE_LABEL, role, WORKER_ROLES)
        return None
    try:
        grpc_port = _parse_port(annotations.get(GRPC_PORT_ANNOTATION)) or DEFAULT_GRPC_PORT
    except ValueError as exc:
        logger.warning("pod %s: annotation %s: %s; ignored", name, GRPC_PORT_ANNOTATION, exc)
        return None
    try:
        metrics_port = _parse_port(annotations.get(METRICS_PORT_ANNOTATION))
    except ValueError as exc:
        logger.warning("pod %s: annotation %s: %s; metrics port unknown", name, METRICS_PORT_ANNOTATION, exc)
        metrics_port = None
    pod_ip = str(pod["status"]["podIP"])
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip  # IPv6 literal
    labels["namespace"] = str(metadata.get("namespace", ""))
    return WorkerEndpoint(worker_id=name, address=f"{host}:{grpc_port}", role=role,
                          metrics_port=metrics_port, labels=labels)


def _parse_port(raw: object) -> int | None:
    """None when absent; ValueError when present but not a TCP port."""
    if raw is None or raw == "":
        return None
    text = str(raw).strip()
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{raw!r} is not a TCP port")
    return int(text)
