"""TLS values of the chart: the public certificate on the gateway, mutual TLS on every service with plaintext
health ports for the kubelet's probes, API keys as a mounted file, and cert-manager Certificates."""

from __future__ import annotations

from typing import Any

import pytest

from .chart import CHART, RELEASE, component_of, container, flag, of_kind, render

pytestmark = pytest.mark.helm

EXAMPLE = CHART / "examples" / "tls-cert-manager.yaml"
INTERNAL = "/etc/radixmesh/tls/internal"


def _by_component(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Deployments by component, workers as worker-<role>."""
    out = {}
    for dep in of_kind(docs, "Deployment").values():
        role = dep["spec"]["template"]["metadata"]["labels"].get("radixmesh.io/role")
        out[component_of(dep) + (f"-{role}" if role else "")] = dep
    return out


def test_defaults_have_a_plaintext_grpc_api_and_no_tls(helm: str) -> None:
    docs = render(helm)
    gateway = _by_component(docs)["gateway"]
    args = container(gateway)["args"]
    assert flag(args, "grpc-port") == "50050" and not any(a.startswith("--tls-") for a in args)
    assert {"name": "grpc", "containerPort": 50050, "protocol": "TCP"} in container(gateway)["ports"]
    service = of_kind(docs, "Service")[f"{RELEASE}-radixmesh-gateway"]
    assert {"name": "grpc", "port": 50050, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"} in \
        service["spec"]["ports"]
    assert not of_kind(docs, "Certificate")
    off = _by_component(render(helm, sets=["gateway.grpcPort=null"]))["gateway"]
    assert flag(container(off)["args"], "grpc-port") is None


def test_api_keys_are_a_mounted_file_not_an_env_var(helm: str) -> None:
    gateway = _by_component(render(helm, sets=["gateway.apiKey.existingSecret=keys", "gateway.apiKey.secretKey=k"]))[
        "gateway"]
    c = container(gateway)
    assert flag(c["args"], "api-key-file") == "/etc/radixmesh/api-keys/k" and flag(c["args"], "api-key") is None
    assert not any("API_KEY" in e["name"] for e in c.get("env", []))
    volume = next(v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == "api-keys")
    assert volume["secret"] == {"secretName": "keys", "items": [{"key": "k", "path": "k"}], "defaultMode": 0o440}
    assert {"name": "api-keys", "mountPath": "/etc/radixmesh/api-keys", "readOnly": True} in c["volumeMounts"]


def test_cert_manager_example_secures_every_link(helm: str) -> None:
    docs = render(helm, [EXAMPLE])
    certificates = of_kind(docs, "Certificate")
    internal = certificates[f"{RELEASE}-radixmesh-internal-tls"]["spec"]
    public = certificates[f"{RELEASE}-radixmesh-gateway-tls"]["spec"]
    assert internal["dnsNames"] == ["radixmesh-internal"] and {"server auth", "client auth"} <= set(internal["usages"])
    assert public["dnsNames"] == ["llm.example.com"] and "client auth" not in public["usages"]
    assert internal["issuerRef"] == public["issuerRef"] == {"name": "radixmesh-ca", "kind": "Issuer"}
    for name, dep in _by_component(docs).items():
        if name in ("redis",):
            continue
        c, pod = container(dep), dep["spec"]["template"]["spec"]
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        assert secrets["tls-internal"] == internal["secretName"], name
        assert {"name": "tls-internal", "mountPath": INTERNAL, "readOnly": True} in c["volumeMounts"], name
        assert flag(c["args"], "tls-ca") == f"{INTERNAL}/ca.crt", name
        assert flag(c["args"], "tls-server-name") == "radixmesh-internal", name
        if name == "gateway":
            assert flag(c["args"], "tls-cert") == "/etc/radixmesh/tls/public/tls.crt"
            assert flag(c["args"], "tls-client-cert") == f"{INTERNAL}/tls.crt"
            assert secrets["tls-public"] == public["secretName"]
            assert flag(c["args"], "api-key-file") == "/etc/radixmesh/api-keys/api-keys"
            continue
        assert flag(c["args"], "tls-cert") == f"{INTERNAL}/tls.crt", name
        assert flag(c["args"], "health-port") == "8086", name
        assert c["readinessProbe"]["grpc"]["port"] == 8086, name


def test_existing_secrets_without_cert_manager(helm: str) -> None:
    docs = render(helm, sets=["tls.public.enabled=true", "tls.public.secretName=gw-cert",
                              "tls.internal.enabled=true", "tls.internal.secretName=mesh-cert"])
    assert not of_kind(docs, "Certificate")
    gateway = _by_component(docs)["gateway"]
    volumes = {v["name"]: v["secret"]["secretName"] for v in gateway["spec"]["template"]["spec"]["volumes"]
               if "secret" in v}
    assert volumes == {"tls-public": "gw-cert", "tls-internal": "mesh-cert"}
