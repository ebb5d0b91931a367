"""The Helm chart, checked with a real helm: lint, render, Kubernetes schemas, RBAC, probes, values schema.

helm comes from `scripts/install.sh test` (built with `go install` into .venv/bin). A missing
helm fails these tests: they are the only check of the chart.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

from .chart import (
    CHART,
    EXAMPLES,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    component_of,
    container,
    flag,
    load_yaml,
    of_kind,
    parse_selector,
    render,
    run_helm,
)

pytestmark = pytest.mark.helm

VALUE_SETS = [pytest.param(None, id="defaults")] + [pytest.param(p, id=p.stem) for p in EXAMPLES]
CRD_KINDS = {"ServiceMonitor": "monitoring.coreos.com/v1", "Certificate": "cert-manager.io/v1",
             "InferencePool": "inference.networking.k8s.io/v1"}
"""Kinds of custom resources the chart may render; the Kubernetes schemas do not cover them."""
THIRD_PARTY = ("redis", "otel-collector")
"""Components that run someone else's image (probed their own way, no radixmesh command line)."""


def _files(values_file: Path | None) -> list[Path]:
    return [values_file] if values_file else []


@pytest.fixture(scope="module")
def rendered(helm: str) -> dict[str, list[dict[str, Any]]]:
    """Manifests of the defaults and of every example (rendered once per module)."""
    out = {"defaults": render(helm)}
    for path in EXAMPLES:
        out[path.stem] = render(helm, [path])
    return out


def _docs(rendered: dict[str, list[dict[str, Any]]], values_file: Path | None) -> list[dict[str, Any]]:
    return rendered[values_file.stem if values_file else "defaults"]


def routing_pod(deployments: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """The Deployment that routes and its routing flags: the router's, or (router.embedded) the gateway's
    --embedded-router string."""
    router = next((d for d in deployments.values() if component_of(d) == "router"), None)
    if router is not None:
        return router, container(router)["args"]
    gateway = next(d for d in deployments.values() if component_of(d) == "gateway")
    return gateway, shlex.split(str(flag(container(gateway)["args"], "embedded-router")))


def test_examples_exist() -> None:
    assert {p.stem for p in EXAMPLES} >= {"unified-1gpu", "pd-2p4d", "external-redis", "autoscaling", "observability",
                                          "tls-cert-manager"}


@pytest.mark.parametrize("values_file", VALUE_SETS)
def test_helm_lint_strict(helm: str, values_file: Path | None) -> None:
    args = ["lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION]
    for path in _files(values_file):
        args += ["-f", str(path)]
    result = run_helm(helm, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("values_file", VALUE_SETS)
def test_manifests_match_kubernetes_schemas(rendered: dict[str, list[dict[str, Any]]],
                                            values_file: Path | None) -> None:
    import kubernetes_validate

    docs = _docs(rendered, values_file)
    assert docs
    errors = []
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"] == CRD_KINDS[doc["kind"]], doc["apiVersion"]
            continue
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']} at {list(exc.path)}: {exc.message}")
    assert not errors, "\n".join(errors)


def test_schema_validation_catches_a_bad_manifest(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The validator itself is strict: a misspelled field and a wrong type are errors."""
    import copy

    import kubernetes_validate

    deployment = copy.deepcopy(next(d for d in rendered["defaults"] if d["kind"] == "Deployment"))
    deployment["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)
    deployment = copy.deepcopy(next(d for d in rendered["defaults"] if d["kind"] == "Deployment"))
    container(deployment)["ports"][0]["containerPort"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("values_file", VALUE_SETS)
def test_objects_refer_to_each_other_consistently(rendered: dict[str, list[dict[str, Any]]],
                                                  values_file: Path | None) -> None:
    """Selectors, named ports, volumes and Secrets line up (the schemas cannot see across objects)."""
    docs = _docs(rendered, values_file)
    deployments = of_kind(docs, "Deployment")
    secrets = set(of_kind(docs, "Secret"))
    values = load_yaml(values_file) if values_file else {}
    external_secrets = {values.get("redis", {}).get("external", {}).get("existingSecret"),
                        values.get("gateway", {}).get("apiKey", {}).get("existingSecret")} - {None, ""}
    secrets |= {c["spec"]["secretName"] for c in of_kind(docs, "Certificate").values()}  # cert-manager fills them
    for name, dep in deployments.items():
        pod = dep["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        volumes = {v["name"] for v in pod["spec"].get("volumes", [])}
        for volume in pod["spec"].get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets | external_secrets, f"{name}: {volume}"
        for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes, f"{name}/{c['name']}"
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] in secrets | external_secrets, f"{name}: Secret {ref['name']} is not rendered"
    for name, svc in of_kind(docs, "Service").items():
        matches = [d for d in deployments.values()
                   if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert matches, f"Service {name} selects no pods"
        for port in svc["spec"]["ports"]:
            for dep in matches:
                names = {p["name"] for p in container(dep)["ports"]}
                assert port["targetPort"] in names, f"Service {name} port {port['name']} -> {dep['metadata']['name']}"


@pytest.mark.parametrize("values_file", VALUE_SETS)
def test_router_rbac_grants_only_reading_pods(rendered: dict[str, list[dict[str, Any]]],
                                              values_file: Path | None) -> None:
    docs = _docs(rendered, values_file)
    assert not of_kind(docs, "ClusterRole") and not of_kind(docs, "ClusterRoleBinding")
    roles = of_kind(docs, "Role")
    for role in roles.values():
        assert role["metadata"]["namespace"] == NAMESPACE
        for rule in role["rules"]:
            assert set(rule) <= {"apiGroups", "resources", "verbs"}, rule  # no resourceNames / nonResourceURLs
            assert rule["apiGroups"] == [""] and rule["resources"] == ["pods"], rule
            assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
    deployments = of_kind(docs, "Deployment")
    router, routing_args = routing_pod(deployments)
    router_sa = router["spec"]["template"]["spec"].get("serviceAccountName")
    uses_kubernetes = flag(routing_args, "discovery") == "kubernetes"
    bindings = of_kind(docs, "RoleBinding")
    if uses_kubernetes:
        assert roles and bindings and router_sa
        for binding in bindings.values():
            assert binding["roleRef"]["name"] in roles and binding["roleRef"]["kind"] == "Role"
            assert binding["subjects"] == [{"kind": "ServiceAccount", "name": router_sa, "namespace": NAMESPACE}]
    else:
        assert not roles and not bindings
    for dep in deployments.values():  # nobody else gets an API token
        if dep is not router:
            assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is False, dep["metadata"]["name"]


@pytest.mark.parametrize("values_file", VALUE_SETS)
def test_workers_carry_discovery_labels_gpus_and_shm(rendered: dict[str, list[dict[str, Any]]],
                                                     values_file: Path | None) -> None:
    docs = _docs(rendered, values_file)
    deployments = of_kind(docs, "Deployment")
    workers = [d for d in deployments.values() if component_of(d) == "worker"]
    assert workers
    selector = flag(routing_pod(deployments)[1], "selector")
    for dep in workers:
        pod = dep["spec"]["template"]
        labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
        c = container(dep)
        role = labels["radixmesh.io/role"]
        assert role in ("unified", "prefill", "decode")
        assert flag(c["args"], "role") == role
        grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        assert annotations["radixmesh.io/grpc-port"] == str(grpc_port)
        assert flag(c["args"], "port") == str(grpc_port)
        if selector is not None:
            assert parse_selector(selector).items() <= labels.items(), "the router's selector misses this worker"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] >= 1
        shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert any(t.get("key") == "nvidia.com/gpu" for t in pod["spec"]["tolerations"])
        assert flag(c["args"], "model")


@pytest.mark.parametrize("values_file", VALUE_SETS)
def test_probes(rendered: dict[str, list[dict[str, Any]]], values_file: Path | None) -> None:
    """gRPC probes on each gRPC service's own port (its plaintext health port under mutual TLS); HTTP(S) probes on
    the gateway; a long startup window for workers. Liveness and startup pass while the process serves; readiness
    follows the service's dependencies."""
    values = load_yaml(values_file) if values_file else {}
    tls = values.get("tls", {})
    for dep in of_kind(_docs(rendered, values_file), "Deployment").values():
        component, c = component_of(dep), container(dep)
        if component in THIRD_PARTY:
            continue
        probes = [c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")]
        if component == "gateway":
            paths = [p["httpGet"]["path"] for p in probes]
            assert paths == ["/live", "/health", "/live"] and all(p["httpGet"]["port"] == "http" for p in probes)
            scheme = "HTTPS" if tls.get("public", {}).get("enabled") else "HTTP"
            assert all(p["httpGet"]["scheme"] == scheme for p in probes)
            continue
        probe_port = "health" if tls.get("internal", {}).get("enabled") else "grpc"
        grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == probe_port)
        assert all(p["grpc"]["port"] == grpc_port for p in probes), component
        assert [p["grpc"]["service"] for p in probes] == ["liveness", "", "liveness"], component
        startup_window_s = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
        assert startup_window_s >= (1200 if component == "worker" else 120), (component, startup_window_s)


def test_pd_example_runs_2_prefill_and_4_decode(rendered: dict[str, list[dict[str, Any]]]) -> None:
    deployments = of_kind(rendered["pd-2p4d"], "Deployment")
    by_role = {d["spec"]["template"]["metadata"]["labels"]["radixmesh.io/role"]: d
               for d in deployments.values() if component_of(d) == "worker"}
    assert set(by_role) == {"prefill", "decode"}
    assert by_role["prefill"]["spec"]["replicas"] == 2 and by_role["decode"]["spec"]["replicas"] == 4
    prefill_args = container(by_role["prefill"])["args"]
    assert flag(prefill_args, "chunked-prefill-size") == "8192"  # role override
    assert flag(prefill_args, "mem-fraction-static") == "0.88"  # shared worker.engine
    assert "--disable-cuda-graph" in prefill_args
    assert "--disable-cuda-graph" not in container(by_role["decode"])["args"]
    decode_args = container(by_role["decode"])["args"]
    assert flag(prefill_args, "kv-transport") == flag(decode_args, "kv-transport") == "auto"  # nixl between pods
    env = {e["name"]: e.get("value") for e in container(by_role["decode"])["env"]}
    assert env["UCX_TCP_PORT_RANGE"] == "52000-52099" and "UCX_TLS" not in env  # UCX's own transport choice
    assert flag(decode_args, "prefill-timeout-s") == "30" and flag(prefill_args, "prefill-timeout-s") is None
    router = next(d for d in deployments.values() if component_of(d) == "router")
    assert flag(container(router)["args"], "pd-min-prefill-tokens") == "256"
    assert by_role["decode"]["spec"]["template"]["spec"]["nodeSelector"] == {"node-pool": "gpu-decode"}
    volumes = by_role["decode"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "llama-3-1-8b", "readOnly": True}} in volumes


def test_network_policies_only_when_enabled(helm: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert not of_kind(rendered["defaults"], "NetworkPolicy")
    policies = of_kind(rendered["pd-2p4d"], "NetworkPolicy")

    def callers(name: str) -> list[dict[str, str]]:
        rules = policies[f"{RELEASE}-radixmesh-{name}"]["spec"]["ingress"]
        assert len(rules) == (2 if name in ("worker-prefill", "worker-decode") else 1), rules  # no metricsFrom
        return [peer["podSelector"]["matchLabels"] for peer in rules[0]["from"]]

    def component_role(labels: dict[str, str]) -> tuple[str, str | None]:
        return labels["app.kubernetes.io/component"], labels.get("radixmesh.io/role")

    assert [component_role(p) for p in callers("router")] == [("gateway", None)]
    assert [component_role(p) for p in callers("tokenizer")] == [("gateway", None)]
    assert [component_role(p) for p in callers("worker-decode")] == [("router", None), ("worker", "prefill")]
    assert [component_role(p) for p in callers("worker-prefill")] == [("router", None), ("worker", "decode")]
    for role, other in (("prefill", "decode"), ("decode", "prefill")):  # nixl's UCX over TCP, between the tiers only
        ucx_rule = policies[f"{RELEASE}-radixmesh-worker-{role}"]["spec"]["ingress"][1]
        assert ucx_rule["ports"] == [{"port": 52000, "endPort": 52099, "protocol": "TCP"}]
        assert [component_role(p["podSelector"]["matchLabels"]) for p in ucx_rule["from"]] == [("worker", other)]
    assert {component_role(p) for p in callers("redis")} == {("router", None), ("worker", None), ("grammar", None)}
    gateway_rules = policies[f"{RELEASE}-radixmesh-gateway"]["spec"]["ingress"]
    assert gateway_rules == [{"ports": [{"port": 8000, "protocol": "TCP"}, {"port": 50050, "protocol": "TCP"}]}]
    unified = of_kind(render(helm, sets=["networkPolicy.enabled=true"]), "NetworkPolicy")
    assert [component_role(p["podSelector"]["matchLabels"])
            for p in unified[f"{RELEASE}-radixmesh-worker-unified"]["spec"]["ingress"][0]["from"]] == [("router", None)]


def test_pdbs_render_when_enabled_and_not_when_disabled(helm: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    pdbs = of_kind(rendered["defaults"], "PodDisruptionBudget")
    names = {n.removeprefix(f"{RELEASE}-radixmesh-") for n in pdbs}
    assert names == {"gateway", "router", "tokenizer", "grammar", "worker-unified"}
    assert all(p["spec"]["maxUnavailable"] == 1 for p in pdbs.values())
    worker_pdb = pdbs[f"{RELEASE}-radixmesh-worker-unified"]["spec"]["selector"]["matchLabels"]
    assert worker_pdb["radixmesh.io/role"] == "unified"
    off = render(helm, sets=[f"{c}.pdb.enabled=false" for c in ("gateway", "router", "tokenizer", "grammar")]
                 + ["workers.unified.pdb.enabled=false"])
    assert not of_kind(off, "PodDisruptionBudget")
    min_available = of_kind(render(helm, sets=["workers.unified.pdb.minAvailable=1"]), "PodDisruptionBudget")
    assert min_available[f"{RELEASE}-radixmesh-worker-unified"]["spec"] == {
        "minAvailable": 1, "selector": {"matchLabels": worker_pdb}}


def test_autoscaling_example(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["autoscaling"]
    hpas = of_kind(docs, "HorizontalPodAutoscaler")
    deployments = of_kind(docs, "Deployment")
    assert {h.removeprefix(f"{RELEASE}-radixmesh-") for h in hpas} == {
        "gateway", "router", "tokenizer", "worker-prefill", "worker-decode"}
    for name, hpa in hpas.items():
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert "replicas" not in deployments[name]["spec"], f"{name}: the HPA owns replicas"
    decode = hpas[f"{RELEASE}-radixmesh-worker-decode"]["spec"]
    assert decode["metrics"][0]["pods"]["metric"]["name"] == "radixmesh_queued_requests"
    assert (decode["minReplicas"], decode["maxReplicas"]) == (2, 16)
    monitors = of_kind(docs, "ServiceMonitor")
    services = of_kind(docs, "Service")
    for monitor in monitors.values():
        selected = [s for s in services.values()
                    if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert selected, monitor["metadata"]["name"]
        port = monitor["spec"]["endpoints"][0]["port"]
        assert all(port in {p["name"] for p in s["spec"]["ports"]} for s in selected)


def test_redis_modes(helm: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    bundled = rendered["defaults"]
    secret = of_kind(bundled, "Secret")[f"{RELEASE}-radixmesh-redis"]
    assert len(secret["data"]["redis-password"]) > 20
    worker = next(d for d in of_kind(bundled, "Deployment").values() if component_of(d) == "worker")
    env = {e["name"]: e for e in container(worker)["env"]}
    assert env["RADIXMESH_REDIS_URL"]["value"] == f"redis://:$(REDIS_PASSWORD)@{RELEASE}-radixmesh-redis:6379/0"
    assert "--redis-url=$(RADIXMESH_REDIS_URL)" in container(worker)["args"]

    external = rendered["external-redis"]
    assert not any(component_of(d) == "redis" for d in of_kind(external, "Deployment").values())
    for dep in of_kind(external, "Deployment").values():
        for e in container(dep).get("env", []):
            if e["name"] == "RADIXMESH_REDIS_URL":
                assert e["valueFrom"]["secretKeyRef"] == {"name": "radixmesh-redis", "key": "redis-url"}

    url_docs = render(helm, sets=["redis.mode=external", "redis.external.url=redis://cache.example:6379/2"])
    url_secret = of_kind(url_docs, "Secret")[f"{RELEASE}-radixmesh-redis-url"]
    assert url_secret["data"]["redis-url"] == "cmVkaXM6Ly9jYWNoZS5leGFtcGxlOjYzNzkvMg=="

    none = render(helm, sets=["redis.mode=none"])
    for dep in of_kind(none, "Deployment").values():
        assert component_of(dep) != "redis"
        assert flag(container(dep).get("args", []), "redis-url") is None


def test_routers_and_workers_open_their_generate_lane(helm: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The lane port is a flag, a named container port, a Service port (the router's: gateways dial it through
    the Service) and allowed by the network policies; null turns it off everywhere."""
    deployments = of_kind(rendered["defaults"], "Deployment")
    services = of_kind(rendered["defaults"], "Service")
    router = deployments[f"{RELEASE}-radixmesh-router"]
    worker = next(d for d in deployments.values() if component_of(d) == "worker")
    for deployment, port in ((router, 50063), (worker, 50061)):
        c = container(deployment)
        assert flag(c["args"], "lane-port") == str(port)
        assert {"name": "lane", "containerPort": port, "protocol": "TCP"} in c["ports"]
    router_service = services[f"{RELEASE}-radixmesh-router"]["spec"]["ports"]
    assert {"name": "lane", "port": 50063, "targetPort": "lane", "protocol": "TCP"} in router_service
    tokenizer = next(d for d in deployments.values() if component_of(d) == "tokenizer")
    assert flag(container(tokenizer)["args"], "lane-port") is None
    policies = of_kind(render(helm, sets=["networkPolicy.enabled=true"]), "NetworkPolicy")
    for name, port in (("router", 50063), ("worker-unified", 50061)):
        ingress = policies[f"{RELEASE}-radixmesh-{name}"]["spec"]["ingress"]
        assert {"port": port, "protocol": "TCP"} in ingress[0]["ports"]
    turned_off = render(helm, sets=["router.lanePort=null", "worker.lanePort=null"])
    for docs in (turned_off, rendered["tls-cert-manager"]):  # internal TLS: Generate stays on the gRPC ports
        for deployment in of_kind(docs, "Deployment").values():
            if component_of(deployment) in ("router", "worker"):
                assert flag(container(deployment)["args"], "lane-port") is None
                assert all(p["name"] != "lane" for p in container(deployment)["ports"])
        router_ports = of_kind(docs, "Service")[f"{RELEASE}-radixmesh-router"]["spec"]["ports"]
        assert all(p["name"] != "lane" for p in router_ports)
