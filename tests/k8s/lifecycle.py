"""A release through its life: install, upgrade with changed values and a new image tag, rollback, uninstall;
after each step the release is whole on the server, and after the uninstall nothing of it is left."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.k8s.helm_release import Helm
from tests.k8s.kube import INSTANCE_LABEL, kubectl, release_leftovers, wait_for
from tests.k8s.release_checks import check_manifest_objects, check_release

IMAGE_PREFIX = "ghcr.io/radixmesh/"
APP_VERSION = "0.1.0"
NEW_TAG = "0.2.0"
UPGRADE_SETS = [f"images.worker.tag={NEW_TAG}", f"images.service.tag={NEW_TAG}", "logLevel=debug"]
"""What every example's upgrade changes: both radixmesh images and every container's --log-level."""


@dataclass
class Release:
    """One release of the chart on the test control plane."""

    helm: Helm
    api_client: Any
    kubectl: str
    kubeconfig: Path
    namespace: str
    name: str
    workdir: Path

    def check(self) -> dict[str, int]:
        check_manifest_objects(self.kubectl, self.kubeconfig, self.helm.manifest(self.name, self.namespace),
                               self.workdir)
        return check_release(self.api_client, self.namespace, self.name)

    def radixmesh_images(self) -> set[str]:
        """Images of the release's running radixmesh containers (init containers included)."""
        from kubernetes import client

        pods = client.CoreV1Api(self.api_client).list_namespaced_pod(
            self.namespace, label_selector=f"{INSTANCE_LABEL}={self.name}").items
        containers = [c for p in pods if p.metadata.deletion_timestamp is None
                      for c in [*p.spec.containers, *(p.spec.init_containers or [])]]
        return {c.image for c in containers if c.image.startswith(IMAGE_PREFIX)}

    def wait_images_tagged(self, tag: str) -> None:
        wait_for(lambda: {i.rsplit(":", 1)[1] for i in self.radixmesh_images()} == {tag}, 30,
                 f"every radixmesh container of {self.name} at tag {tag}")

    def wait_nothing_left(self, timeout_s: float = 60.0) -> None:
        left: list[str] = []

        def nothing_left() -> bool:
            left[:] = release_leftovers(self.kubectl, self.kubeconfig, self.name)
            return not left

        try:
            wait_for(nothing_left, timeout_s, f"nothing of release {self.name} left", poll_s=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; left: {left}") from None


def run_lifecycle(release: Release, values: list[Path], timings: dict[str, float], label: str) -> dict[str, int]:
    """Install, upgrade (UPGRADE_SETS), rollback to revision 1 and uninstall, checking after each step; the
    installed release's object counts (check_release)."""
    helm, name, namespace = release.helm, release.name, release.namespace
    helm.install(name, namespace, values=values)
    counts = release.check()
    release.wait_images_tagged(APP_VERSION)
    helm.upgrade(name, namespace, values=values, sets=UPGRADE_SETS)
    release.check()
    release.wait_images_tagged(NEW_TAG)
    helm.rollback(name, namespace, revision=1)
    release.check()
    release.wait_images_tagged(APP_VERSION)
    assert [(h["revision"], h["status"]) for h in helm.history(name, namespace)] == \
        [(1, "superseded"), (2, "superseded"), (3, "deployed")]
    assert not helm.api_warnings, f"the API server warned: {helm.api_warnings}"
    helm.uninstall(name, namespace)
    release.wait_nothing_left()
    assert not kubectl(release.kubectl, release.kubeconfig, "get", "all", "-n", namespace, "-o", "name").strip(), \
        "objects left in the release's namespace"
    for step in ("install", "upgrade", "rollback", "uninstall"):
        timings[f"{step} {label}"] = helm.timings_s[f"{step} {name}"]
    return counts
