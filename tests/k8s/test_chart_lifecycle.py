"""One release through its life on a real API server: install, upgrade with changed values and a new image
tag, rollback, uninstall; after the uninstall nothing of it is left in any namespace."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from tests.k8s.control_plane import ControlPlane
from tests.k8s.helm_release import Helm
from tests.k8s.kube import release_leftovers, wait_for, wait_running
from tests.k8s.release_checks import check_release

RELEASE = "life"
WORKERS = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=worker"


def worker_images(core: Any, namespace: str, count: int) -> set[str]:
    """Images of the worker pods, once exactly `count` of them run (the old ones gone)."""
    pods = wait_running(core, namespace, WORKERS, count)
    return {c.image for p in pods for c in p.spec.containers}


def router_args(apps: Any, namespace: str) -> list[str]:
    deployment = apps.read_namespaced_deployment(f"{RELEASE}-radixmesh-router", namespace)
    return list(deployment.spec.template.spec.containers[0].args)


def redis_password(core: Any, namespace: str) -> str:
    secret = core.read_namespaced_secret(f"{RELEASE}-radixmesh-redis", namespace)
    return base64.b64decode(secret.data["redis-password"]).decode()


@pytest.fixture
def helm(k8s: ControlPlane, helm_binary: str) -> Helm:
    return Helm(helm_binary, k8s.kubeconfig)


def test_install_upgrade_rollback_uninstall(k8s: ControlPlane, helm: Helm, namespace: str,
                                            k8s_timings: dict[str, float], kubectl_binary: str) -> None:
    from kubernetes import client

    api_client = k8s.api_client()
    core, apps = client.CoreV1Api(api_client), client.AppsV1Api(api_client)

    helm.install(RELEASE, namespace)
    check_release(api_client, namespace, RELEASE)
    assert worker_images(core, namespace, 1) == {"ghcr.io/radixmesh/radixmesh-worker:0.1.0"}
    assert "--policy=cache-aware" in router_args(apps, namespace)
    password = redis_password(core, namespace)

    changed = ["images.worker.tag=0.2.0", "images.service.tag=0.2.0", "workers.unified.replicas=3",
               "router.policy=round-robin", "logLevel=debug"]
    helm.upgrade(RELEASE, namespace, sets=changed)
    check_release(api_client, namespace, RELEASE)
    assert worker_images(core, namespace, 3) == {"ghcr.io/radixmesh/radixmesh-worker:0.2.0"}
    assert "--policy=round-robin" in router_args(apps, namespace)
    assert redis_password(core, namespace) == password, "the generated Redis password must survive an upgrade"

    helm.rollback(RELEASE, namespace, revision=1)
    check_release(api_client, namespace, RELEASE)
    assert worker_images(core, namespace, 1) == {"ghcr.io/radixmesh/radixmesh-worker:0.1.0"}
    assert "--policy=cache-aware" in router_args(apps, namespace)
    assert redis_password(core, namespace) == password
    history = helm.history(RELEASE, namespace)
    assert [(h["revision"], h["status"]) for h in history] == [(1, "superseded"), (2, "superseded"), (3, "deployed")]

    helm.uninstall(RELEASE, namespace)
    left: list[str] = []

    def nothing_left() -> bool:
        left[:] = release_leftovers(kubectl_binary, k8s.kubeconfig, RELEASE)
        return not left

    try:
        wait_for(nothing_left, 60, f"nothing of release {RELEASE} left")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; left: {left}") from None
    for step in ("install", "upgrade", "rollback", "uninstall"):
        k8s_timings[f"{step} (lifecycle)"] = helm.timings_s[f"{step} {RELEASE}"]
