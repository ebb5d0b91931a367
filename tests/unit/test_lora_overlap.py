"""The LoRA shrink beside the base GEMM on the CPU: when it applies (`radixmesh.engine.lora.overlap`), the split
shrink and expand calls into a buffer allocated up front (Triton interpreter) against `lora_ref`, and the fork /
side / join order around the base projection (`radixmesh.kernels.lora_overlap`) with a recording stand-in for the
two CUDA streams."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.engine.lora.layers import LoraBatchState, LoraProjection, row_runs
from radixmesh.engine.lora.overlap import expands_on_side, may_overlap
from radixmesh.kernels import _pdl, lora_overlap
from radixmesh.kernels.lora import LoraBatch, kernel_config, lora_expand, lora_shrink, shrink_shape
from radixmesh.kernels.lora_overlap import StreamPair, lora_overlapped
from radixmesh.kernels.lora_ref import lora_ref, row_slots

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MAX_RANK = 16
RANKS = [16, 8, 0]  # slot 2 is empty
SCALINGS = [2.0, 0.5, 1.0]
SLICES = (32, 16, 16)  # q/k/v
IN_FEATURES = 64


def _adapters(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(len(RANKS), len(SLICES) * MAX_RANK, IN_FEATURES, generator=gen) * 0.1
    b = torch.randn(len(RANKS), sum(SLICES), MAX_RANK, generator=gen) * 0.1
    return a, b, torch.tensor(RANKS, dtype=torch.int32), torch.tensor(SCALINGS, dtype=torch.float32)


def _want(x: torch.Tensor, y: torch.Tensor, slots: list[int]) -> torch.Tensor:
    a, b, ranks, scalings = _adapters()
    return lora_ref(x, y, a, b, row_slots(torch.tensor(slots, dtype=torch.int32), None, x.shape[0]), ranks,
                    scalings, SLICES)


# ---- when ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "kind", "segmented", "rows", "want"), [
    ("auto", "rows", False, 32, True),  # the decode batch of issue 46
    ("auto", "rows", False, 2, True),
    ("auto", "rows", False, 1, False),  # one row: the GEMV (and its epilogue) path
    ("auto", "rows", True, 32, False),  # prefill segments
    ("auto", "grouped", False, 32, False),
    ("on", "rows", True, 32, True),
    ("on", "grouped", False, 32, True),
    ("on", "rows", False, 1, True),
    ("on", "fused", False, 4, False),  # one launch: no shrink of its own
    ("on", "rows", False, 0, False),
    ("off", "rows", False, 32, False),
    ("side", "rows", False, 32, True),  # as "on", the expand beside the GEMM too
    ("side", "grouped", False, 32, True),
    ("side", "fused", False, 4, False),
])
def test_may_overlap(mode: str, kind: str, segmented: bool, rows: int, want: bool) -> None:
    """(On the CPU no projection asks: `LoraProjection.overlap_kind` is None there, tested below.)"""
    assert may_overlap(mode, kind, segmented, rows) is want


def test_auto_and_side_put_the_expand_on_the_side_stream_on_does_not() -> None:
    assert expands_on_side("auto") and expands_on_side("side")
    assert not expands_on_side("on") and not expands_on_side("off")


def test_an_unknown_mode_is_an_error() -> None:
    with pytest.raises(AssertionError, match="lora overlap"):
        may_overlap("always", "rows", False, 32)


def test_pdl_can_be_refused_per_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pdl, "pdl_enabled", lambda device: True)
    assert _pdl.pdl_args(DEVICE) == {"PDL": True, "launch_pdl": True}
    assert _pdl.pdl_args(DEVICE, allowed=False) == {"PDL": False}


# ---- the split calls -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["rows", "grouped"])
@pytest.mark.parametrize("rows", [3, 8])
def test_shrink_into_a_buffer_then_expand_match_the_reference(kind: str, rows: int) -> None:
    """The overlap path's calls: tiles chosen once, the shrink's buffer allocated before it, no PDL."""
    slots = [(0, 1, -1, 2)[i % 4] for i in range(rows)]
    gen = torch.Generator().manual_seed(rows)
    x, y = torch.randn(rows, IN_FEATURES, generator=gen), torch.randn(rows, sum(SLICES), generator=gen)
    a, b, ranks, scalings = (t.to(DEVICE) for t in _adapters())
    batch = LoraBatch.per_row(torch.tensor(slots, dtype=torch.int32, device=DEVICE))
    cfg = kernel_config(kind, batch, IN_FEATURES, SLICES, MAX_RANK, len(RANKS), DEVICE)
    xa = torch.full(shrink_shape(cfg, rows, len(SLICES), MAX_RANK), float("nan"), device=DEVICE)
    assert lora_shrink(x.to(DEVICE), a, batch, ranks, len(SLICES), xa, cfg, kind, pdl=False) is xa
    got = lora_expand(xa, b, batch, ranks, scalings, y.clone().to(DEVICE), SLICES, cfg, kind, pdl=False)
    torch.testing.assert_close(got.cpu(), _want(x, y, slots), rtol=1e-4, atol=1e-4)


def test_shrink_shape_is_the_shape_lora_shrink_allocates() -> None:
    x = torch.randn(5, IN_FEATURES, device=DEVICE)
    a, _, ranks, _ = (t.to(DEVICE) for t in _adapters())
    batch = LoraBatch.per_row(torch.tensor([0, 1, 0, 2, -1], dtype=torch.int32, device=DEVICE))
    cfg = kernel_config("rows", batch, IN_FEATURES, SLICES, MAX_RANK, len(RANKS), DEVICE)
    assert tuple(lora_shrink(x, a, batch, ranks, len(SLICES), config=cfg).shape) == shrink_shape(cfg, 5, 3, MAX_RANK)


# ---- fork, side, join ------------------------------------------------------------------------------------------
class RecordingStreams(StreamPair):
    """Two streams that only record what is asked of them (and whether a launch ran on the side)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.on_side_now = False

    def fork(self) -> None:
        self.events.append("fork")

    @contextmanager
    def _side(self) -> Any:
        self.events.append("side")
        self.on_side_now = True
        try:
            yield
        finally:
            self.on_side_now = False
            self.events.append("main")

    def on_side(self) -> AbstractContextManager[Any]:
        return self._side()

    def join(self) -> None:
        self.events.append("join")


def _overlapped(x: torch.Tensor, project: Any, streams: StreamPair, kind: str = "rows",
                expand_on_side: bool = False) -> torch.Tensor:
    a, b, ranks, scalings = (t.to(DEVICE) for t in _adapters())
    batch = LoraBatch.per_row(torch.tensor([0, 1, 2, -1][:x.shape[0]], dtype=torch.int32, device=DEVICE))
    return lora_overlapped(x.to(DEVICE), project, a, b, batch, ranks, scalings, SLICES, kind, streams,
                           expand_on_side=expand_on_side)


@pytest.mark.parametrize("kind", ["rows", "grouped"])
@pytest.mark.parametrize(("expand_on_side", "order"), [
    (False, ["fork", "side", "lora_shrink", "main", "base", "join", "lora_expand"]),  # the expand after the join
    (True, ["fork", "side", "lora_shrink", "lora_expand", "main", "base", "join"]),  # then one add
], ids=["expand-after", "expand-on-side"])
def test_the_adapters_run_on_the_side_while_the_base_runs_on_the_main_stream(
        monkeypatch: pytest.MonkeyPatch, kind: str, expand_on_side: bool, order: list[str]) -> None:
    streams = RecordingStreams()

    def recorded(name: str, call: Any, side: bool) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            assert streams.on_side_now is side, f"{name} on the {'side' if side else 'main'} stream"
            assert kwargs.get("pdl", True) is False, f"{name} launched without PDL"
            streams.events.append(name)
            return call(*args, **kwargs)

        return launch

    monkeypatch.setattr(lora_overlap, "lora_shrink", recorded("lora_shrink", lora_shrink, True))
    monkeypatch.setattr(lora_overlap, "lora_expand", recorded("lora_expand", lora_expand, expand_on_side))
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, IN_FEATURES, generator=gen), torch.randn(sum(SLICES), IN_FEATURES, generator=gen)

    def base(inp: torch.Tensor) -> torch.Tensor:
        assert not streams.on_side_now, "the base GEMM runs on the main stream"
        streams.events.append("base")
        return inp @ w.to(inp.device).t()

    got = _overlapped(x, base, streams, kind, expand_on_side=expand_on_side)
    assert streams.events == order
    torch.testing.assert_close(got.cpu(), _want(x, x @ w.t(), [0, 1, 2, -1]), rtol=1e-4, atol=1e-4)


def test_the_side_stream_joins_when_the_base_projection_fails() -> None:
    streams = RecordingStreams()

    def broken(inp: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("GEMM failed")

    with pytest.raises(RuntimeError, match="GEMM failed"):
        _overlapped(torch.randn(4, IN_FEATURES), broken, streams)
    assert streams.events[-1] == "join"


# ---- the projection -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", ["auto", "on", "side", "off"])
def test_the_cpu_projection_only_validates_the_option(overlap: str) -> None:
    """On the CPU every setting runs the matmul path after the base projection."""
    a, b, ranks, scalings = _adapters()
    slots = [0, 0, 1, -1, 2]
    state = LoraBatchState(ranks, scalings, RANKS, SCALINGS, active=True, runs=row_runs(slots), overlap=overlap)
    proj = LoraProjection(state, a, b, SLICES)
    x = torch.randn(5, IN_FEATURES, generator=torch.Generator().manual_seed(4))
    w = torch.randn(sum(SLICES), IN_FEATURES, generator=torch.Generator().manual_seed(5))
    assert proj.overlap_kind(x) is None
    torch.testing.assert_close(proj.project(x, lambda inp: inp @ w.t()), _want(x, x @ w.t(), slots),
                               rtol=1e-4, atol=1e-4)
