"""What an installed release must look like on the API server, beyond `helm install --wait`:

- every pod of the release Running and Ready on a node (workers included: kwok runs them);
- every object of the release's manifest is on the server (check_manifest_objects);
- every Service selects ready pods, and each of its ports resolves to a container port in the EndpointSlices
  (a selector or targetPort name that matches nothing shows here, never in `helm template`);
- every PodDisruptionBudget, NetworkPolicy, ServiceMonitor and InferencePool selects something, every HPA
  targets an existing Deployment, every InferencePool's endpoint picker is a Service with that port;
- every pod that watches pods (`--discovery=kubernetes`: the router, or the gateway with an embedded
  router) mounts a token of a ServiceAccount that RBAC lets get, list and watch pods in its namespace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.k8s.kube import INSTANCE_LABEL, is_running_ready, wait_for
from tests.k8s.kube import kubectl as kubectl_get

TIMEOUT_S = 30.0


def selector_string(match_labels: dict[str, str] | None) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted((match_labels or {}).items()))


def check_release(api_client: Any, namespace: str, release: str) -> dict[str, int]:
    """Assert the release is whole (see the module docstring); returns counts by kind, for messages."""
    from kubernetes import client

    core, apps = client.CoreV1Api(api_client), client.AppsV1Api(api_client)
    selector = f"{INSTANCE_LABEL}={release}"
    deployments = apps.list_namespaced_deployment(namespace, label_selector=selector).items
    assert deployments, f"release {release} has no Deployments"
    try:
        num_pods = wait_for(lambda: _all_pods_ready(core, apps, namespace, selector), TIMEOUT_S,
                            f"the pods of every Deployment of {release} Running and Ready")
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{describe_pods(core, namespace, selector)}") from None
    services = core.list_namespaced_service(namespace, label_selector=selector).items
    for service in services:
        wait_for(lambda s=service: _service_resolves(api_client, namespace, s), TIMEOUT_S,
                 f"Service {service.metadata.name} with ready endpoints on every port")
    counts = {"Deployment": len(deployments), "Pod": num_pods, "Service": len(services)}
    counts["PodDisruptionBudget"] = _check_pdbs(api_client, namespace, selector)
    counts["NetworkPolicy"] = _check_network_policies(api_client, core, namespace, selector)
    counts["HorizontalPodAutoscaler"] = _check_hpas(api_client, apps, namespace, selector)
    counts["ServiceMonitor"] = _check_service_monitors(api_client, core, namespace, selector)
    counts["InferencePool"] = _check_inference_pools(api_client, core, namespace, selector)
    counts["pod watchers"] = _check_pod_watchers(api_client, core, namespace, selector)
    return counts


def describe_pods(core: Any, namespace: str, selector: str) -> str:
    """One line per pod: name, phase, node and the reason of any false condition (the scheduler's says why)."""
    lines = []
    for pod in core.list_namespaced_pod(namespace, label_selector=selector).items:
        status = pod.status
        reasons = [f"{c.type}={c.status} {c.reason or ''} {c.message or ''}".strip()
                   for c in (status.conditions or []) if c.status != "True"]
        lines.append(f"{pod.metadata.name}: {status.phase} on {pod.spec.node_name or '-'}; {'; '.join(reasons)}")
    return "\n".join(lines)


def _all_pods_ready(core: Any, apps: Any, namespace: str, selector: str) -> int:
    """The number of pods when each Deployment has its replicas (an HPA may change them) all Running and Ready
    on a node, else 0."""
    deployments = apps.list_namespaced_deployment(namespace, label_selector=selector).items
    wanted = sum(d.spec.replicas or 0 for d in deployments)
    pods = [p for p in core.list_namespaced_pod(namespace, label_selector=selector).items
            if p.metadata.deletion_timestamp is None]
    ok = len(pods) == wanted and all(is_running_ready(p) and p.spec.node_name for p in pods)
    return len(pods) if ok else 0


def _service_resolves(api_client: Any, namespace: str, service: Any) -> bool:
    """Every port of the Service has a resolved port and at least one ready endpoint in its EndpointSlices."""
    from kubernetes import client

    if not service.spec.selector:
        return True
    slices = client.DiscoveryV1Api(api_client).list_namespaced_endpoint_slice(
        namespace, label_selector=f"kubernetes.io/service-name={service.metadata.name}").items
    for port in service.spec.ports:
        ready = [s for s in slices
                 if any(p.name == port.name and p.port for p in s.ports or [])
                 and any(e.conditions and e.conditions.ready for e in s.endpoints or [])]
        if not ready:
            return False
    return True


def _check_pdbs(api_client: Any, namespace: str, selector: str) -> int:
    from kubernetes import client

    policy = client.PolicyV1Api(api_client)
    pdbs = policy.list_namespaced_pod_disruption_budget(namespace, label_selector=selector).items
    for pdb in pdbs:
        name = pdb.metadata.name
        wait_for(lambda n=name: (policy.read_namespaced_pod_disruption_budget(n, namespace).status.expected_pods
                                 or 0) > 0, TIMEOUT_S, f"PodDisruptionBudget {name} covering pods")
    return len(pdbs)


def _check_network_policies(api_client: Any, core: Any, namespace: str, selector: str) -> int:
    from kubernetes import client

    policies = client.NetworkingV1Api(api_client).list_namespaced_network_policy(namespace,
                                                                                 label_selector=selector).items
    for policy in policies:
        pod_selector = selector_string(policy.spec.pod_selector.match_labels)
        assert core.list_namespaced_pod(namespace, label_selector=pod_selector).items, \
            f"NetworkPolicy {policy.metadata.name} selects no pod ({pod_selector})"
    return len(policies)


def _check_hpas(api_client: Any, apps: Any, namespace: str, selector: str) -> int:
    from kubernetes import client

    hpas = client.AutoscalingV2Api(api_client).list_namespaced_horizontal_pod_autoscaler(
        namespace, label_selector=selector).items
    for hpa in hpas:
        target = hpa.spec.scale_target_ref
        assert target.kind == "Deployment", f"HPA {hpa.metadata.name} targets a {target.kind}"
        apps.read_namespaced_deployment(target.name, namespace)  # 404 raises
    return len(hpas)


def _check_service_monitors(api_client: Any, core: Any, namespace: str, selector: str) -> int:
    from kubernetes import client

    try:
        monitors = client.CustomObjectsApi(api_client).list_namespaced_custom_object(
            "monitoring.coreos.com", "v1", namespace, "servicemonitors", label_selector=selector)["items"]
    except client.ApiException as exc:
        if exc.status == 404:  # no CRD in this cluster: the chart rendered none (helm would have failed)
            return 0
        raise
    for monitor in monitors:
        service_selector = selector_string(monitor["spec"]["selector"].get("matchLabels"))
        services = core.list_namespaced_service(namespace, label_selector=service_selector).items
        assert services, f"ServiceMonitor {monitor['metadata']['name']} selects no Service ({service_selector})"
        port_names = {p.name for s in services for p in s.spec.ports}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in port_names, \
                f"ServiceMonitor {monitor['metadata']['name']}: port {endpoint['port']} not in {port_names}"
    return len(monitors)


def check_manifest_objects(kubectl: str, kubeconfig: Path, manifest: str, workdir: Path) -> list[str]:
    """Every object of `manifest` (helm get manifest) exists on the server; their kind/name."""
    path = workdir / "manifest.yaml"
    path.write_text(manifest)
    names = kubectl_get(kubectl, kubeconfig, "get", "-f", str(path), "-o", "name").split()
    documents = [d for d in yaml.safe_load_all(manifest) if d]
    assert len(names) == len(documents), f"{len(documents)} objects rendered, {len(names)} found: {names}"
    return names


def _check_inference_pools(api_client: Any, core: Any, namespace: str, selector: str) -> int:
    from kubernetes import client

    try:
        pools = client.CustomObjectsApi(api_client).list_namespaced_custom_object(
            "inference.networking.k8s.io", "v1", namespace, "inferencepools", label_selector=selector)["items"]
    except client.ApiException as exc:
        if exc.status == 404:  # no CRD in this cluster: the chart rendered none (helm would have failed)
            return 0
        raise
    for pool in pools:
        name, spec = pool["metadata"]["name"], pool["spec"]
        pod_selector = selector_string(spec["selector"]["matchLabels"])
        pods = [p for p in core.list_namespaced_pod(namespace, label_selector=pod_selector).items
                if is_running_ready(p)]
        assert pods, f"InferencePool {name} selects no ready pod ({pod_selector})"
        ports = {p.container_port for pod in pods for c in pod.spec.containers for p in c.ports or []}
        for target in spec["targetPorts"]:
            assert target["number"] in ports, f"InferencePool {name}: no pod serves port {target['number']}"
        picker = spec.get("endpointPickerRef")
        if picker:
            service = core.read_namespaced_service(picker["name"], namespace)
            assert picker["port"]["number"] in {p.port for p in service.spec.ports}, \
                f"InferencePool {name}: Service {picker['name']} has no port {picker['port']['number']}"
    return len(pools)


def _check_pod_watchers(api_client: Any, core: Any, namespace: str, selector: str) -> int:
    """Pods running Kubernetes discovery have a token of an account allowed to get/list/watch pods; their count."""
    from kubernetes import client

    auth = client.AuthorizationV1Api(api_client)
    watchers = [p for p in core.list_namespaced_pod(namespace, label_selector=selector).items
                if any("--discovery=kubernetes" in arg for c in p.spec.containers for arg in c.args or [])]
    for pod in watchers:
        spec = pod.spec
        assert spec.automount_service_account_token is not False, f"{pod.metadata.name} watches pods without a token"
        user = f"system:serviceaccount:{namespace}:{spec.service_account_name}"
        for verb in ("get", "list", "watch"):
            review = {"spec": {"user": user, "resourceAttributes": {"namespace": namespace, "verb": verb,
                                                                     "resource": "pods"}}}
            assert auth.create_subject_access_review(review).status.allowed, \
                f"{pod.metadata.name} runs discovery as {user}, which may not {verb} pods in {namespace}"
    return len(watchers)
