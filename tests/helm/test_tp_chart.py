"""Tensor-parallel workers in the chart: `engine.tpSize` reaches `--tp-size` and sets the pod's GPUs."""

from __future__ import annotations

from typing import Any

import pytest

from .chart import CHART, component_of, container, flag, of_kind, render, run_helm, template_args

pytestmark = pytest.mark.helm


def _workers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["spec"]["template"]["metadata"]["labels"]["radixmesh.io/role"]: d
            for d in of_kind(docs, "Deployment").values() if component_of(d) == "worker"}


def _gpus(dep: dict[str, Any]) -> tuple[Any, Any]:
    resources = container(dep)["resources"]
    return resources["requests"].get("nvidia.com/gpu"), resources["limits"].get("nvidia.com/gpu")


def test_tp4_example_asks_for_4_gpus_per_pod(helm: str) -> None:
    worker = _workers(render(helm, [CHART / "examples" / "unified-tp4-70b.yaml"]))["unified"]
    assert flag(container(worker)["args"], "tp-size") == "4"
    assert _gpus(worker) == (4, 4)


def test_gpus_follow_each_roles_tp_size(helm: str) -> None:
    workers = _workers(render(helm, [CHART / "examples" / "pd-2p4d.yaml"],
                              sets=["workers.decode.engine.tpSize=2", "workers.decode.gpus=null"]))
    assert flag(container(workers["decode"])["args"], "tp-size") == "2" and _gpus(workers["decode"]) == (2, 2)
    assert flag(container(workers["prefill"])["args"], "tp-size") == "1" and _gpus(workers["prefill"]) == (1, 1)


def test_explicit_gpus_win_and_zero_means_a_cpu_worker(helm: str) -> None:
    more = _workers(render(helm, sets=["worker.engine.tpSize=2", "worker.gpus=4"]))["unified"]
    assert _gpus(more) == (4, 4)
    cpu = _workers(render(helm, sets=["worker.engine.tpSize=2", "worker.gpus=0"]))["unified"]
    assert _gpus(cpu) == (None, None) and flag(container(cpu)["args"], "tp-size") == "2"


@pytest.mark.parametrize(("sets", "message"), [
    (["worker.engine.tpSize=0"], "/worker/engine/tpSize"),
    (["worker.engine.tpSize=two"], "/worker/engine/tpSize"),
    (["worker.engine.tpSize=4", "worker.gpus=2"], "workers.unified: 2 GPUs cannot hold engine.tpSize=4 ranks"),
])
def test_bad_tp_values_fail_with_a_clear_message(helm: str, sets: list[str], message: str) -> None:
    result = run_helm(helm, *template_args(sets=sets))
    assert result.returncode != 0, f"{sets} rendered without error"
    assert message in result.stderr, result.stderr
