"""Which pods are workers, and where they listen (Kubernetes discovery's pod rules)."""

from __future__ import annotations

from typing import Any

import pytest

from radixmesh.common.errors import RadixMeshError
from radixmesh.router.discovery.kubernetes import KubernetesDiscoveryConfig
from radixmesh.router.discovery.kubernetes_pods import endpoint_from_pod, is_pod_ready


def pod(labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
        ready: str = "True", ip: str | None = "10.1.2.3", phase: str = "Running") -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase, "conditions": [{"type": "Ready", "status": ready}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": {"name": "w", "namespace": "ns", "labels": labels or {}, "annotations": annotations or {}},
            "status": status}


def test_defaults_role_unified_and_port_50051() -> None:
    endpoint = endpoint_from_pod(pod())
    assert endpoint is not None
    assert (endpoint.worker_id, endpoint.address, endpoint.role, endpoint.metrics_port) == \
        ("w", "10.1.2.3:50051", "unified", None)
    assert endpoint.labels["namespace"] == "ns"


def test_role_label_and_port_annotations() -> None:
    endpoint = endpoint_from_pod(pod({"radixmesh.io/role": "decode"},
                                     {"radixmesh.io/grpc-port": "7000", "radixmesh.io/metrics-port": "9090"}))
    assert endpoint is not None
    assert (endpoint.address, endpoint.role, endpoint.metrics_port) == ("10.1.2.3:7000", "decode", 9090)


@pytest.mark.parametrize("port", ["http", "0", "70000", "-1"])
def test_bad_grpc_port_annotation_ignores_the_pod(port: str) -> None:
    assert endpoint_from_pod(pod(annotations={"radixmesh.io/grpc-port": port})) is None


def test_bad_metrics_port_only_drops_the_metrics_port() -> None:
    endpoint = endpoint_from_pod(pod(annotations={"radixmesh.io/metrics-port": "x"}))
    assert endpoint is not None and endpoint.metrics_port is None


def test_unknown_role_ignores_the_pod() -> None:
    assert endpoint_from_pod(pod({"radixmesh.io/role": "draft"})) is None


@pytest.mark.parametrize("kwargs", [{"ready": "False"}, {"ip": None}, {"phase": "Pending"}, {"phase": "Succeeded"}])
def test_not_ready_pods_are_not_workers(kwargs: dict[str, Any]) -> None:
    assert not is_pod_ready(pod(**kwargs))
    assert endpoint_from_pod(pod(**kwargs)) is None


def test_terminating_pod_is_not_a_worker() -> None:
    terminating = pod()
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert endpoint_from_pod(terminating) is None


def test_ipv6_address_is_bracketed() -> None:
    endpoint = endpoint_from_pod(pod(ip="fd00::1"))
    assert endpoint is not None and endpoint.address == "[fd00::1]:50051"


@pytest.mark.parametrize("kwargs", [{"selector": " "}, {"namespace": ""}, {"watch_timeout_s": 0},
                                    {"backoff_initial_s": 5.0, "backoff_max_s": 1.0}])
def test_config_rejects_bad_values(kwargs: dict[str, Any]) -> None:
    settings: dict[str, Any] = {"selector": "a=b", "namespace": "ns", **kwargs}
    with pytest.raises(RadixMeshError):
        KubernetesDiscoveryConfig(**settings)
