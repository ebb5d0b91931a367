"""Fixtures of the k8s tests: one real control plane for the session (tests/k8s/control_plane.py), a fresh
namespace per test, helm and kubectl pointed at it. A missing binary fails the tests: scripts/install.sh test
builds them."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator

import pytest

from tests.helm.chart import find_helm
from tests.k8s.binaries import MissingBinary, find_binaries
from tests.k8s.control_plane import ControlPlane
from tests.k8s.kube import wait_for
from tests.xdist_scheduling import K8S_TIMINGS

_TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    """etcd, kube-apiserver, controller manager, scheduler and kwok with one fake node, stopped at the end."""
    try:
        binaries = find_binaries()
    except MissingBinary as exc:
        pytest.fail(str(exc))
    plane = ControlPlane.start(binaries)
    _TIMINGS.update({f"control plane {k}": v for k, v in plane.timings_s.items()})
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def k8s(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    """The session's control plane, checked to be still running before and after the test."""
    control_plane.check_running()
    yield control_plane
    control_plane.check_running()
    request.node.user_properties.append((K8S_TIMINGS, dict(_TIMINGS)))  # printed by tests/conftest.py


@pytest.fixture
def namespace(k8s: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A new namespace for one test, deleted after it (its pods at once, the rest without waiting)."""
    from kubernetes import client

    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{slug}-{secrets.token_hex(3)}"
    api = client.CoreV1Api(k8s.api_client())
    api.create_namespace({"metadata": {"name": name}})
    # pods are refused until the controller manager has made the namespace's default ServiceAccount
    wait_for(lambda: any(a.metadata.name == "default" for a in api.list_namespaced_service_account(name).items),
             30, f"ServiceAccount {name}/default")
    yield name
    # Terminating refuses new pods; its pods then go at once, freeing their node resources (GPUs) for the next
    # test instead of when the namespace controller gets to them.
    api.delete_namespace(name)
    api.delete_collection_namespaced_pod(name, grace_period_seconds=0)


@pytest.fixture(scope="session")
def kubectl_binary(control_plane: ControlPlane) -> str:
    return control_plane.binaries.kubectl


@pytest.fixture(scope="session")
def helm_binary() -> str:
    path = find_helm()
    if path is None:
        pytest.fail("helm not found (next to python or on PATH): run `scripts/install.sh test`")
    return path


@pytest.fixture(scope="session")
def k8s_timings() -> dict[str, float]:
    """Seconds of the steps the k8s tests time (printed at the end of the run)."""
    return _TIMINGS

