from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from grpc.experimental import aio as _grpc_aio

from tests.xdist_scheduling import K8S_TIMINGS, make_scheduler, order_for_workers

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
TEST_TORCH_THREADS = "1"
"""PyTorch's intra-op threads in the pytest process and in every service the tests start (they inherit the
environment), unless OMP_NUM_THREADS is set. The tests' models are small, and with two threads per process on
a 2-core machine any other busy process makes each op wait for a descheduled thread: at a load of 7 the same
unit tests took 125 s instead of 35 s, and at 9 the tool-calling test's `serve` generated 3x fewer tokens per
second. Set before the first import of torch, which reads it once."""
os.environ.setdefault("OMP_NUM_THREADS", TEST_TORCH_THREADS)
# Without CUDA, Triton kernels run under the interpreter. The mode of a kernel is fixed when its
# module is first imported, by whichever test module imports radixmesh first: set it here, before
# any of them, so that no test depends on the order in which files are collected.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


# gRPC's asyncio stack shares one completion queue and poller thread per process, created with the first
# grpc.aio object and shut down when the last one is freed. Tests run many event loops one after another,
# so that shutdown happens again and again, at whatever moment garbage collection frees the last object
# (after its loop closed, with operations still pending): twice the join of the poller thread never
# returned and the run stalled. Holding one reference for the whole session keeps the queue alive, as a
# long-running service's one event loop does.
_grpc_aio.init_grpc_aio()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: long units of work first
        order_for_workers(items)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`-n N` without `--dist`: whole modules (and the k8s tests together) per worker, the long ones first."""
    return make_scheduler(config, log) if config.getvalue("dist") == "load" else None


TEST_TIMES = "" if os.environ.get("PYTEST_XDIST_WORKER") else os.environ.get("RADIXMESH_TEST_TIMES", "")
"""A file to append each test phase's duration to as it ends (one JSON line: test, when, s, outcome), so a
long run shows where its time goes even when it is stopped early. With pytest-xdist the main process writes
it (it gets every worker's reports), not the workers too."""


_k8s_timings: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if TEST_TIMES:
        with open(TEST_TIMES, "a") as out:
            out.write(json.dumps({"test": report.nodeid, "when": report.when, "s": round(report.duration, 2),
                                  "outcome": report.outcome}) + "\n")
    for name, value in report.user_properties:
        if name == K8S_TIMINGS and isinstance(value, dict):
            _k8s_timings.update(value)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _k8s_timings:
        terminalreporter.write_sep("-", K8S_TIMINGS)
        for name, seconds in _k8s_timings.items():
            terminalreporter.write_line(f"{seconds:8.2f} s  {name}")


@pytest.fixture(autouse=True)
def _same_torch_rng_state() -> None:
    """Every test starts from one torch RNG state (CPU and CUDA generators), so a test drawing from the global
    generators draws the same numbers in every run, whichever tests ran before it in the process."""
    torch = sys.modules.get("torch")  # (tests that never import torch pay nothing)
    if torch is not None:
        torch.manual_seed(0)


@pytest.fixture(scope="session")
def default_model_dir():
    from radixmesh.engine.loader.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def default_engine() -> Iterator[Any]:
    """One in-process `Engine()` (the default model, default settings) for every test that needs no other:
    starting one costs seconds. Tests that need an empty prefix cache flush it first."""
    from radixmesh import Engine

    with Engine() as engine:
        yield engine
