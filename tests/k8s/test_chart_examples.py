"""The chart on a real API server: the default values, and every example installed, upgraded (new image tag,
changed values), rolled back and uninstalled (tests/k8s/lifecycle.py).

kwok runs the pods (no image is pulled), so `helm install --wait` returns once the Deployments are
available; release_checks.py then checks what only a real cluster shows (selectors, ports, budgets).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helm.chart import EXAMPLES
from tests.k8s import chart_prereqs, nodes
from tests.k8s.control_plane import ControlPlane
from tests.k8s.helm_release import Helm
from tests.k8s.lifecycle import Release, run_lifecycle

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

CRDS: list[str] = []
"""The CRDs the example cluster has (names)."""


@pytest.fixture(scope="module")
def example_cluster(control_plane: ControlPlane) -> ControlPlane:
    """The session's control plane with the CRDs the chart may render and the examples' labelled GPU nodes."""
    api_client = control_plane.api_client()
    CRDS[:] = chart_prereqs.install_crds(api_client)
    for node in chart_prereqs.EXAMPLE_NODES:
        nodes.create_kwok_node(api_client, node)
    nodes.wait_nodes_ready(api_client, [n.name for n in chart_prereqs.EXAMPLE_NODES], control_plane.check_running)
    return control_plane


@pytest.fixture
def release(example_cluster: ControlPlane, helm_binary: str, kubectl_binary: str, namespace: str,
            tmp_path: Path) -> Release:
    helm = Helm(helm_binary, example_cluster.kubeconfig, kubectl_binary)
    return Release(helm, example_cluster.api_client(), kubectl_binary, example_cluster.kubeconfig, namespace, "rm",
                   tmp_path)


def test_install_default_values(release: Release, k8s_timings: dict[str, float]) -> None:
    release.helm.install(release.name, release.namespace)
    k8s_timings["install default"] = release.helm.timings_s["install rm"]
    counts = release.check()
    assert not release.helm.api_warnings, release.helm.api_warnings
    # gateway, router, tokenizer, grammar, redis and the unified workers; the same Services, the workers' headless
    assert (counts["Deployment"], counts["Service"], counts["Pod"]) == (6, 6, 8), counts
    assert counts["PodDisruptionBudget"] == 5 and counts["pod watchers"] == 1, counts


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_lifecycle(release: Release, example: Path, k8s_timings: dict[str, float]) -> None:
    from kubernetes import client

    has_pool = "inferencePool:" in example.read_text()
    if has_pool and "inferencepools.inference.networking.k8s.io" not in CRDS:
        pytest.skip(f"{chart_prereqs.INFERENCE_EXTENSION} (the InferencePool CRD) is not in the Go module cache: "
                    f"scripts/install.sh test downloads it")
    volumes = chart_prereqs.prepare_example(release.api_client, release.namespace, example)
    try:
        counts = run_lifecycle(release, [example], k8s_timings, example.stem)
        assert counts["InferencePool"] == (1 if has_pool else 0), counts
    finally:
        for volume in volumes:
            client.CoreV1Api(release.api_client).delete_persistent_volume(volume)
