"""inferencePool: an InferencePool over the unified workers' HTTP API, with the router as its endpoint picker."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from radixmesh.router.commands import add_epp_args, add_routing_args

from .chart import EXAMPLES, NAMESPACE, RELEASE, component_of, container, flag, of_kind, render, run_helm, template_args

pytestmark = pytest.mark.helm

EXAMPLE = next(p for p in EXAMPLES if p.stem == "inference-pool")
EXTENSION = "sigs.k8s.io/gateway-api-inference-extension@v1.0.0"
CRD_PATH = "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"


def _deployment(docs: list[dict[str, Any]], component: str, role: str | None = None) -> dict[str, Any]:
    return next(d for d in of_kind(docs, "Deployment").values() if component_of(d) == component
                and (role is None or d["spec"]["template"]["metadata"]["labels"].get("radixmesh.io/role") == role))


def _router_flags(router: dict[str, Any]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_routing_args(parser)
    add_epp_args(parser)
    parser.add_argument("--redis-url")
    args = [a for a in container(router)["args"][1:] if a.startswith("--") and not a.startswith(
        ("--host", "--port", "--metrics-port", "--log-level", "--drain-timeout-s", "--lane-port"))]
    return parser.parse_args(args)


def test_the_pool_selects_the_unified_workers_and_names_the_router_as_picker(helm: str) -> None:
    docs = render(helm, [EXAMPLE])
    [pool] = of_kind(docs, "InferencePool").values()
    assert pool["metadata"]["name"] == "qwen-pool" and pool["metadata"]["namespace"] == NAMESPACE
    unified = _deployment(docs, "worker", "unified")
    pod_labels = unified["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pool["spec"]["selector"]["matchLabels"]["radixmesh.io/role"] == "unified"
    worker = container(unified)
    http = next(p for p in worker["ports"] if p["name"] == "http")
    assert pool["spec"]["targetPorts"] == [{"number": http["containerPort"]}]
    assert flag(worker["args"], "http-port") == str(http["containerPort"])
    assert flag(worker["args"], "served-model-name") == "qwen2.5-7b"
    ref = pool["spec"]["endpointPickerRef"]
    service = of_kind(docs, "Service")[ref["name"]]
    epp = next(p for p in service["spec"]["ports"] if p["name"] == "epp")
    assert ref["port"] == {"number": epp["port"]} and ref["failureMode"] == "FailClose"
    assert epp["appProtocol"] == "kubernetes.io/h2c"
    router = _deployment(docs, "router")
    assert service["spec"]["selector"].items() <= router["spec"]["template"]["metadata"]["labels"].items()
    assert any(p["name"] == "epp" and p["containerPort"] == epp["port"] for p in container(router)["ports"])
    flags = _router_flags(router)
    assert flags.epp_port == epp["port"] and flags.epp_fallbacks == 0 and flags.epp_max_queue == 64
    tokenizer = of_kind(docs, "Service")[f"{RELEASE}-radixmesh-tokenizer"]
    assert flags.tokenizer == f"{RELEASE}-radixmesh-tokenizer:{tokenizer['spec']['ports'][0]['port']}"


def test_the_gateways_proxies_may_reach_the_workers_http_port_and_the_picker(helm: str) -> None:
    docs = render(helm, [EXAMPLE], sets=["inferencePool.from[0].namespaceSelector.matchLabels.gw=proxies"])
    policies = of_kind(docs, "NetworkPolicy")
    for name, port in ((f"{RELEASE}-radixmesh-worker-unified", 8000), (f"{RELEASE}-radixmesh-router", 9002)):
        rules = [r for r in policies[name]["spec"]["ingress"] if r["ports"] == [{"port": port, "protocol": "TCP"}]]
        assert rules and rules[0]["from"] == [{"namespaceSelector": {"matchLabels": {"gw": "proxies"}}}], policies[name]
    everyone = of_kind(render(helm, [EXAMPLE]), "NetworkPolicy")[f"{RELEASE}-radixmesh-worker-unified"]
    assert {"ports": [{"port": 8000, "protocol": "TCP"}]} in everyone["spec"]["ingress"]


def test_off_by_default_and_with_a_picker_of_ones_own(helm: str) -> None:
    docs = render(helm)
    assert not of_kind(docs, "InferencePool")
    assert flag(container(_deployment(docs, "worker", "unified"))["args"], "http-port") is None
    assert flag(container(_deployment(docs, "router"))["args"], "epp-port") is None
    own = render(helm, sets=["inferencePool.enabled=true", "inferencePool.endpointPicker.enabled=false",
                             "inferencePool.endpointPickerRef.name=my-epp", "inferencePool.failureMode=FailOpen"])
    [pool] = of_kind(own, "InferencePool").values()
    assert pool["spec"]["endpointPickerRef"] == {"name": "my-epp", "port": {"number": 9002}, "failureMode": "FailOpen"}
    assert flag(container(_deployment(own, "router"))["args"], "epp-port") is None


@pytest.mark.parametrize(("sets", "message"), [
    (["inferencePool.enabled=true", "router.embedded=true"], "set router.embedded=false"),
    (["inferencePool.enabled=true", "workers.unified.enabled=false", "workers.prefill.enabled=true",
      "workers.decode.enabled=true"], "enable workers.unified"),
    (["inferencePool.enabled=true", "inferencePool.endpointPicker.enabled=false"], "give endpointPickerRef.name"),
    (["inferencePool.enabled=true", "inferencePool.targetPort=50051"], "inferencePool.targetPort must differ"),
    (["inferencePool.enabled=true", "inferencePool.endpointPicker.port=9090"], "endpointPicker.port must differ"),
    (["inferencePool.failureMode=Retry"], "/inferencePool/failureMode"),
    (["inferencePool.endpointPicker.fallbacks=20"], "/inferencePool/endpointPicker/fallbacks"),
    (["inferencePool.name=Bad_Name"], "/inferencePool/name"),
])
def test_bad_pool_values_fail_clearly(helm: str, sets: list[str], message: str) -> None:
    result = run_helm(helm, *template_args(sets=sets))
    assert result.returncode != 0 and message in result.stderr, result.stderr


def _inference_pool_crd() -> dict[str, Any] | None:
    """The extension's v1.0.0 InferencePool CRD from the Go module cache (scripts/install.sh test downloads it)."""
    go = shutil.which("go")
    if go is None:
        return None
    cache = subprocess.run([go, "env", "GOMODCACHE"], capture_output=True, text=True, check=False).stdout.strip()
    path = Path(cache) / EXTENSION / CRD_PATH
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def test_the_pool_matches_the_extensions_crd_schema(helm: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    crd = _inference_pool_crd()
    if crd is None:
        pytest.skip(f"{EXTENSION} is not in the Go module cache (scripts/install.sh test downloads it)")
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = version["schema"]["openAPIV3Schema"]
    for docs in (render(helm, [EXAMPLE]), render(helm, sets=["inferencePool.enabled=true"])):
        [pool] = of_kind(docs, "InferencePool").values()
        jsonschema.validate(pool, schema)
    bad = dict(pool, spec={**pool["spec"], "targetPorts": [{"number": 0}]})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
