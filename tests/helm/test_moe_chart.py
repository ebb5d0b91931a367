"""Mixture-of-experts workers in the chart: `engine.epSize` (EP size = GPUs per pod), `engine.moeDispatch` and
`engine.enableDpAttention` reach the worker's flags, and an EP size other than 1 or the pod's tensor-parallel size,
or data-parallel attention where it does not run, fails with a clear message."""

from __future__ import annotations

import pytest

from .chart import CHART, container, flag, render, run_helm, template_args
from .test_tp_chart import _gpus, _workers

pytestmark = pytest.mark.helm


def test_moe_example_spreads_experts_over_the_pods_gpus(helm: str) -> None:
    worker = _workers(render(helm, [CHART / "examples" / "moe-ep2-mixtral.yaml"]))["unified"]
    args = container(worker)["args"]
    assert flag(args, "tp-size") == "2" and flag(args, "ep-size") == "2"
    assert _gpus(worker) == (2, 2)


def test_dispatch_and_per_role_ep_size(helm: str) -> None:
    workers = _workers(render(helm, [CHART / "examples" / "pd-2p4d.yaml"], sets=[
        "workers.decode.engine.tpSize=2", "workers.decode.engine.epSize=2", "workers.decode.gpus=null",
        "worker.engine.moeDispatch=all-to-all"]))
    decode, prefill = container(workers["decode"])["args"], container(workers["prefill"])["args"]
    assert flag(decode, "ep-size") == "2" and flag(decode, "moe-dispatch") == "all-to-all"
    assert flag(prefill, "ep-size") is None and flag(prefill, "moe-dispatch") == "all-to-all"


def test_default_workers_have_no_moe_flags(helm: str) -> None:
    args = container(_workers(render(helm))["unified"])["args"]
    assert flag(args, "ep-size") is None and flag(args, "moe-dispatch") is None
    assert "--enable-dp-attention" not in args


def test_data_parallel_attention_reaches_the_workers_flags(helm: str) -> None:
    worker = _workers(render(helm, [CHART / "examples" / "moe-ep2-mixtral.yaml"], sets=[
        "worker.engine.enableDpAttention=true", "worker.engine.disableCudaGraph=true"]))["unified"]
    args = container(worker)["args"]
    assert "--enable-dp-attention" in args and "--disable-cuda-graph" in args and flag(args, "ep-size") == "2"


@pytest.mark.parametrize(("sets", "message"), [
    (["worker.engine.tpSize=4", "worker.engine.epSize=2"],
     "workers.unified: engine.epSize=2: expert parallelism spreads the experts over the pod's GPUs: set it to "
     "engine.tpSize (4), or 1"),
    (["worker.engine.epSize=0"], "/worker/engine/epSize"),
    (["worker.engine.moeDispatch=broadcast"], "/worker/engine/moeDispatch"),
    (["worker.engine.tpSize=2", "worker.engine.enableDpAttention=true", "worker.engine.disableCudaGraph=true"],
     "workers.unified: engine.enableDpAttention runs on unified workers with engine.epSize = engine.tpSize > 1 "
     "(got 1 and 2)"),
    (["worker.engine.tpSize=2", "worker.engine.epSize=2", "worker.engine.enableDpAttention=true"],
     "and engine.disableCudaGraph=true"),
])
def test_bad_moe_values_fail_with_a_clear_message(helm: str, sets: list[str], message: str) -> None:
    result = run_helm(helm, *template_args(sets=sets))
    assert result.returncode != 0, f"{sets} rendered without error"
    assert message in result.stderr, result.stderr
