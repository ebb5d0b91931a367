"""The default values through a release's life with a closer look: replicas, the router's flags and the
generated Redis password follow install, upgrade and rollback; uninstall leaves nothing behind."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from tests.k8s.control_plane import ControlPlane
from tests.k8s.helm_release import Helm
from tests.k8s.kube import wait_running
from tests.k8s.lifecycle import Release

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

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


def test_install_upgrade_rollback_uninstall(k8s: ControlPlane, helm_binary: str, kubectl_binary: str,
                                            namespace: str, tmp_path: Path, k8s_timings: dict[str, float]) -> None:
    from kubernetes import client

    helm = Helm(helm_binary, k8s.kubeconfig, kubectl_binary)
    api_client = k8s.api_client()
    release = Release(helm, api_client, kubectl_binary, k8s.kubeconfig, namespace, RELEASE, tmp_path)
    core, apps = client.CoreV1Api(api_client), client.AppsV1Api(api_client)

    helm.install(RELEASE, namespace)
    release.check()
    assert worker_images(core, namespace, 1) == {"ghcr.io/radixmesh/radixmesh-worker:0.1.0"}
    assert "--policy=cache-aware" in router_args(apps, namespace)
    password = redis_password(core, namespace)

    helm.upgrade(RELEASE, namespace, sets=["images.worker.tag=0.2.0", "workers.unified.replicas=3",
                                           "router.policy=round-robin"])
    release.check()
    assert worker_images(core, namespace, 3) == {"ghcr.io/radixmesh/radixmesh-worker:0.2.0"}
    assert "--policy=round-robin" in router_args(apps, namespace)
    assert redis_password(core, namespace) == password, "the generated Redis password must survive an upgrade"

    helm.rollback(RELEASE, namespace, revision=1)
    release.check()
    assert worker_images(core, namespace, 1) == {"ghcr.io/radixmesh/radixmesh-worker:0.1.0"}
    assert "--policy=cache-aware" in router_args(apps, namespace)
    assert redis_password(core, namespace) == password

    assert not helm.api_warnings, f"the API server warned: {helm.api_warnings}"
    helm.uninstall(RELEASE, namespace)
    release.wait_nothing_left()
    for step in ("install", "upgrade", "rollback", "uninstall"):
        k8s_timings[f"{step} default (replicas, policy)"] = helm.timings_s[f"{step} {RELEASE}"]
