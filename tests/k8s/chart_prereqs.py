"""What the chart's examples expect the cluster to have, made in the test cluster.

- CRDs of the objects the chart renders for other projects: the Prometheus Operator's ServiceMonitor and
  cert-manager's Certificate as minimal CRDs of our own (group, version, kind, names, a structural schema
  that keeps any spec), not the operators' full ones: the API server stores and serves the objects, but does
  not check their specs as the real CRDs' schemas would. The Gateway API Inference Extension's InferencePool
  CRD is the real one, from the extension's module (scripts/install.sh test downloads it), so the server
  checks the chart's pools against its schema.
- Fake nodes with the labels, taints and GPUs the examples' nodeSelectors, tolerations and anti-affinity
  ask for.
- Per example, read from its values: the existing Secrets it names (with the keys it names), a bound
  PersistentVolumeClaim for model.source.type=pvc, and the namespace of the Grafana dashboard.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.k8s.kube import wait_for
from tests.k8s.nodes import FakeNode

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
EXAMPLE_NODES = (
    # pd-2p4d: prefill pods (one GPU each) on distinct gpu-prefill nodes (required anti-affinity), decode on gpu-decode
    FakeNode("kwok-prefill-0", {"node-pool": "gpu-prefill", "nvidia.com/gpu.present": "true"}, gpus=1,
             taints=(GPU_TAINT,)),
    FakeNode("kwok-prefill-1", {"node-pool": "gpu-prefill", "nvidia.com/gpu.present": "true"}, gpus=1,
             taints=(GPU_TAINT,)),
    FakeNode("kwok-decode-0", {"node-pool": "gpu-decode", "nvidia.com/gpu.present": "true"}, gpus=8,
             taints=(GPU_TAINT,)),
    # unified-tp4-70b: two pods of 4 GPUs on nodes labelled with 4 GPUs
    FakeNode("kwok-gpu4-0", {"nvidia.com/gpu.count": "4", "nvidia.com/gpu.present": "true"}, gpus=4,
             taints=(GPU_TAINT,)),
    FakeNode("kwok-gpu4-1", {"nvidia.com/gpu.count": "4", "nvidia.com/gpu.present": "true"}, gpus=4,
             taints=(GPU_TAINT,)),
    # moe-ep2-mixtral: two pods of 2 GPUs (EP 2 x TP 2) on nodes labelled with 2 GPUs
    FakeNode("kwok-gpu2-0", {"nvidia.com/gpu.count": "2", "nvidia.com/gpu.present": "true"}, gpus=2,
             taints=(GPU_TAINT,)),
    FakeNode("kwok-gpu2-1", {"nvidia.com/gpu.count": "2", "nvidia.com/gpu.present": "true"}, gpus=2,
             taints=(GPU_TAINT,)),
)


def _crd(group: str, kind: str, plural: str) -> dict[str, Any]:
    schema = {"type": "object", "properties": {"spec": {"type": "object",
                                                        "x-kubernetes-preserve-unknown-fields": True}}}
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{group}"},
            "spec": {"group": group, "scope": "Namespaced",
                     "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
                     "versions": [{"name": "v1", "served": True, "storage": True,
                                   "schema": {"openAPIV3Schema": schema}}]}}


CRDS = (_crd("monitoring.coreos.com", "ServiceMonitor", "servicemonitors"),
        _crd("cert-manager.io", "Certificate", "certificates"))


INFERENCE_EXTENSION = "sigs.k8s.io/gateway-api-inference-extension@v1.0.0"
INFERENCE_POOL_CRD = "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"


def inference_pool_crd() -> dict[str, Any] | None:
    """The extension's InferencePool CRD from the Go module cache, or None when it was not downloaded."""
    go = shutil.which("go")
    cache = subprocess.run([go, "env", "GOMODCACHE"], capture_output=True, text=True, check=False).stdout.strip() \
        if go else str(Path.home() / "go" / "pkg" / "mod")
    path = Path(cache) / INFERENCE_EXTENSION / INFERENCE_POOL_CRD
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def install_crds(api_client: Any) -> list[str]:
    """Create the CRDs (if missing) and wait until the API server serves them; the names of those made."""
    from kubernetes import client

    api = client.ApiextensionsV1Api(api_client)
    pool = inference_pool_crd()
    crds = [*CRDS, pool] if pool else list(CRDS)
    for crd in crds:
        try:
            api.create_custom_resource_definition(crd)
        except client.ApiException as exc:
            if exc.status != 409:
                raise

    def established() -> bool:
        for crd in crds:
            conditions = api.read_custom_resource_definition(crd["metadata"]["name"]).status.conditions or []
            if not any(c.type == "Established" and c.status == "True" for c in conditions):
                return False
        return True

    wait_for(established, 30, "CRDs established")
    return [crd["metadata"]["name"] for crd in crds]


def prepare_example(api_client: Any, namespace: str, example: Path) -> list[str]:
    """Make what `example` names but does not create; returns the names of cluster-scoped objects made
    (PersistentVolumes) for the caller to delete."""
    from kubernetes import client

    values = yaml.safe_load(example.read_text()) or {}
    core = client.CoreV1Api(api_client)
    for name, key in _existing_secrets(values):
        core.create_namespaced_secret(namespace, {"metadata": {"name": name},
                                                  "stringData": {key: f"test-{key}"}})
    dashboards_ns = ((values.get("grafana") or {}).get("dashboards") or {}).get("namespace")
    if dashboards_ns:
        _ensure_namespace(core, dashboards_ns)
    source = (values.get("model") or {}).get("source") or {}
    if source.get("type") == "pvc":
        return [_bound_claim(core, namespace, source["pvc"]["claimName"])]
    return []


def _existing_secrets(values: dict[str, Any]) -> list[tuple[str, str]]:
    """(Secret, key) pairs the values name as already existing."""
    found = []
    external = ((values.get("redis") or {}).get("external")) or {}
    if external.get("existingSecret"):
        found.append((external["existingSecret"], external.get("existingSecretKey", "redis-url")))
    bundled = ((values.get("redis") or {}).get("bundled")) or {}
    if bundled.get("existingSecret"):
        found.append((bundled["existingSecret"], bundled.get("existingSecretKey", "redis-password")))
    api_key = ((values.get("gateway") or {}).get("apiKey")) or {}
    if api_key.get("existingSecret"):
        found.append((api_key["existingSecret"], api_key.get("secretKey", "api-key")))
    return found


def _ensure_namespace(core: Any, name: str) -> None:
    from kubernetes import client

    try:
        core.create_namespace({"metadata": {"name": name}})
    except client.ApiException as exc:
        if exc.status != 409:
            raise


def _bound_claim(core: Any, namespace: str, claim: str) -> str:
    """A PersistentVolume pre-bound to a new claim `claim` (static provisioning), once the claim is Bound."""
    pv = f"{namespace}-{claim}"[:63]
    core.create_persistent_volume({
        "metadata": {"name": pv},
        "spec": {"capacity": {"storage": "500Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                 "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": f"/models-{claim}"},
                 "claimRef": {"namespace": namespace, "name": claim}}})
    core.create_namespaced_persistent_volume_claim(namespace, {
        "metadata": {"name": claim},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv,
                 "resources": {"requests": {"storage": "500Gi"}}}})
    wait_for(lambda: core.read_namespaced_persistent_volume_claim(claim, namespace).status.phase == "Bound",
             30, f"claim {namespace}/{claim} Bound")
    return pv
