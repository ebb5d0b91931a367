"""Rollouts that drop nothing: every radixmesh pod keeps serving for a preStop wait, then drains on SIGTERM
within its drain timeout, and its termination grace covers both."""

from __future__ import annotations

from typing import Any

import pytest

from .chart import component_of, container, flag, of_kind, render

pytestmark = pytest.mark.helm
THIRD_PARTY = ("redis", "otel-collector")


def radixmesh_pods(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in of_kind(docs, "Deployment").values() if component_of(d) not in THIRD_PARTY]


def drain_s(dep: dict[str, Any]) -> float:
    args = container(dep)["args"]
    value = flag(args, "graceful-shutdown-s") if component_of(dep) == "gateway" else flag(args, "drain-timeout-s")
    return float(str(value))


@pytest.mark.parametrize("pre_stop_s", [5, 12])
def test_pre_stop_wait_and_grace_match_the_drain(helm: str, pre_stop_s: int) -> None:
    pods = radixmesh_pods(render(helm, sets=[f"shutdown.preStopSeconds={pre_stop_s}", "grammar.enabled=true",
                                            "worker.drainTimeoutSeconds=90"]))
    assert {component_of(d) for d in pods} >= {"gateway", "router", "tokenizer", "grammar", "worker"}
    for dep in pods:
        spec = dep["spec"]["template"]["spec"]
        hook = container(dep)["lifecycle"]["preStop"]["exec"]["command"]
        assert hook == ["sleep", str(pre_stop_s)], component_of(dep)
        assert spec["terminationGracePeriodSeconds"] == pre_stop_s + drain_s(dep) + 15, component_of(dep)
    worker = next(d for d in pods if component_of(d) == "worker")
    assert drain_s(worker) == 90


def test_no_pre_stop_hook_when_turned_off(helm: str) -> None:
    for dep in radixmesh_pods(render(helm, sets=["shutdown.preStopSeconds=0"])):
        assert "lifecycle" not in container(dep), component_of(dep)
        assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == drain_s(dep) + 15


def test_the_values_schema_bounds_the_wait(helm: str) -> None:
    from .chart import run_helm, template_args

    result = run_helm(helm, *template_args(sets=["shutdown.preStopSeconds=-1"]))
    assert result.returncode != 0 and "preStopSeconds" in result.stderr
