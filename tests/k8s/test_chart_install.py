"""`helm install` of the chart into a real API server: the default values and every example.

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
from tests.k8s.release_checks import check_release


@pytest.fixture(scope="module")
def example_cluster(control_plane: ControlPlane) -> ControlPlane:
    """The session's control plane with the operators' CRDs and the examples' labelled GPU nodes."""
    api_client = control_plane.api_client()
    chart_prereqs.install_crds(api_client)
    for node in chart_prereqs.EXAMPLE_NODES:
        nodes.create_kwok_node(api_client, node)
    nodes.wait_nodes_ready(api_client, [n.name for n in chart_prereqs.EXAMPLE_NODES], control_plane.check_running)
    return control_plane


@pytest.fixture
def helm(example_cluster: ControlPlane, helm_binary: str) -> Helm:
    return Helm(helm_binary, example_cluster.kubeconfig)


def test_install_default_values(example_cluster: ControlPlane, helm: Helm, namespace: str,
                                k8s_timings: dict[str, float]) -> None:
    helm.install("rm", namespace)
    k8s_timings["install default"] = helm.timings_s.pop("install rm")
    counts = check_release(example_cluster.api_client(), namespace, "rm")
    # gateway, router, tokenizer, grammar, redis and the unified workers
    assert counts["Deployment"] == 6, counts
    assert counts["Service"] == 6, counts  # the same, with the workers' headless Service


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_install_example(example_cluster: ControlPlane, helm: Helm, namespace: str, example: Path,
                         k8s_timings: dict[str, float]) -> None:
    from kubernetes import client

    api_client = example_cluster.api_client()
    volumes = chart_prereqs.prepare_example(api_client, namespace, example)
    try:
        helm.install("rm", namespace, values=[example])
        k8s_timings[f"install {example.stem}"] = helm.timings_s.pop("install rm")
        check_release(api_client, namespace, "rm")
    finally:
        for volume in volumes:
            client.CoreV1Api(api_client).delete_persistent_volume(volume)
