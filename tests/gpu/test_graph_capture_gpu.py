"""The engine's one capture session (engine/graph_capture.py): a captured run replays on new inputs, graphs share the
session's pool, and garbage collection comes back on however the session ends."""

from __future__ import annotations

import gc

import pytest
import torch

from radixmesh.engine.graph_capture import GraphCapture

pytestmark = [pytest.mark.gpu]


def test_a_captured_run_replays_on_new_inputs_and_gc_comes_back() -> None:
    assert gc.isenabled()
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    calls: list[bool] = []

    def run() -> torch.Tensor:
        calls.append(gc.isenabled())
        return x * 2 + 1

    with GraphCapture() as session:
        graph, out = session.capture(run)
        small, small_out = session.capture(lambda: x[:4] - 1)
    assert calls == [False, False, False]  # two warm-up runs and the captured one, all without gc
    assert gc.isenabled()
    x.copy_(torch.full_like(x, 3.0))
    graph.replay()
    small.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [7.0] * 8 and small_out.tolist() == [2.0] * 4


def test_gc_comes_back_after_a_failed_capture() -> None:
    def run() -> None:
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"), GraphCapture() as session:
        session.capture(run)
    assert gc.isenabled()
