"""The discovery's test hook that dials pods on loopback ports (off unless RADIXMESH_TEST_POD_LOOPBACK_MAP)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixmesh.common.errors import RadixMeshError
from radixmesh.router.discovery.base import WorkerEndpoint
from radixmesh.router.discovery.kubernetes import KubernetesDiscovery, make_kubernetes_discovery
from radixmesh.router.discovery.loopback_map import PodLoopbackMap, load_pod_loopback_map, pod_loopback_map_from_env


def test_address_is_base_port_plus_offset_in_the_network() -> None:
    loopback = PodLoopbackMap(pod_cidr="10.244.0.0/24", base_port=40000)
    assert loopback.address_of("10.244.0.0") == "127.0.0.1:40000"
    assert loopback.address_of("10.244.0.17") == "127.0.0.1:40017"
    assert loopback.address_of("10.244.0.255") == "127.0.0.1:40255"
    assert loopback.address_of("10.244.1.1") is None
    assert loopback.address_of("fd00::1") is None
    assert loopback.address_of("not-an-ip") is None


def test_apply_keeps_the_endpoint_but_its_address() -> None:
    loopback = PodLoopbackMap(pod_cidr="10.244.0.0/24", base_port=40000)
    endpoint = WorkerEndpoint("pod-a", "10.244.0.3:50051", "decode", metrics_port=9090, labels={"a": "b"})
    mapped = loopback.apply(endpoint)
    assert mapped == WorkerEndpoint("pod-a", "127.0.0.1:40003", "decode", metrics_port=9090)
    assert mapped is not None and mapped.labels == {"a": "b"}
    assert loopback.apply(WorkerEndpoint("pod-b", "10.1.0.3:50051")) is None
    assert loopback.apply(WorkerEndpoint("pod-c", "[fd00::3]:50051")) is None


@pytest.mark.parametrize("cidr, base", [("10.244.0.0/24", 65300), ("10.244.0.0/24", 80), ("10.244.0.0/33", 40000),
                                        ("not-a-network", 40000), ("10.244.0.0/8", 40000)])
def test_bad_maps_are_refused(cidr: str, base: int) -> None:
    with pytest.raises(RadixMeshError):
        PodLoopbackMap(pod_cidr=cidr, base_port=base)


def test_off_unless_the_variable_names_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RADIXMESH_TEST_POD_LOOPBACK_MAP", raising=False)
    assert pod_loopback_map_from_env() is None
    discovery = make_kubernetes_discovery("app=w", "ns")
    assert isinstance(discovery, KubernetesDiscovery) and discovery.config.loopback is None

    path = tmp_path / "map.json"
    path.write_text(json.dumps({"pod_cidr": "10.244.0.0/24", "base_port": 41000}))
    monkeypatch.setenv("RADIXMESH_TEST_POD_LOOPBACK_MAP", str(path))
    discovery = make_kubernetes_discovery("app=w", "ns")
    assert isinstance(discovery, KubernetesDiscovery)
    assert discovery.config.loopback == PodLoopbackMap(pod_cidr="10.244.0.0/24", base_port=41000)


def test_a_broken_map_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "map.json"
    path.write_text('{"pod_cidr": "10.244.0.0/24"}')
    with pytest.raises(RadixMeshError, match="not a pod loopback map"):
        load_pod_loopback_map(str(path))
    with pytest.raises(RadixMeshError, match="not a pod loopback map"):
        load_pod_loopback_map(str(tmp_path / "missing.json"))
