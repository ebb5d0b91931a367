"""router.embedded: no router objects; the gateway routes with the router's flags, reaches workers and Redis."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

import pytest

from radixmesh.router.commands import add_routing_args

from .chart import EXAMPLES, component_of, container, flag, of_kind, render

pytestmark = pytest.mark.helm

EXAMPLE = next(p for p in EXAMPLES if p.stem == "embedded-router")


def _gateway(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(d for d in of_kind(docs, "Deployment").values() if component_of(d) == "gateway")


def _routing_flags(gateway: dict[str, Any]) -> argparse.Namespace:
    """The --embedded-router string, parsed as the gateway parses it (a bad flag exits)."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_routing_args(parser)
    value = flag(container(gateway)["args"], "embedded-router")
    assert value is not None
    return parser.parse_args(shlex.split(value))


def test_the_gateway_routes_in_place_of_a_router(helm: str) -> None:
    docs = render(helm, [EXAMPLE])
    router_kinds = {d["kind"] for d in docs if d["metadata"]["name"].endswith("-router")}
    assert router_kinds <= {"ServiceAccount"}, router_kinds  # no Deployment, Service, PDB, HPA or policy
    gateway = _gateway(docs)
    args = container(gateway)["args"]
    assert flag(args, "router") is None
    routing = _routing_flags(gateway)
    assert routing.policy == "cache-aware" and routing.discovery == "kubernetes"
    assert "--redis-url" not in (flag(args, "embedded-router") or "")  # from RADIXMESH_REDIS_URL instead
    env = {e["name"] for e in container(gateway).get("env", [])}
    assert "RADIXMESH_REDIS_URL" in env
    pod = gateway["spec"]["template"]["spec"]
    account = of_kind(docs, "ServiceAccount")
    assert pod["serviceAccountName"] in account and pod["automountServiceAccountToken"] is True
    binding = next(iter(of_kind(docs, "RoleBinding").values()))
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
    policies = of_kind(docs, "NetworkPolicy")
    senders = {name: {f["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                      for rule in p["spec"].get("ingress", []) for f in rule.get("from", []) if "podSelector" in f}
               for name, p in policies.items()}
    workers = [s for name, s in senders.items() if "-worker-" in name]
    assert workers and all("gateway" in s and "router" not in s for s in workers), senders
    assert "gateway" in next(s for name, s in senders.items() if name.endswith("-redis"))


def test_redis_discovery_needs_no_api_token(helm: str) -> None:
    docs = render(helm, sets=["router.embedded=true", "router.discovery=redis"])
    gateway = _gateway(docs)
    assert _routing_flags(gateway).discovery == "redis"
    assert gateway["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert not of_kind(docs, "Role")
