"""The projections' row-count ladder of the warm-up (scheduler/gemm_warmup.py)."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import pytest
import torch

from radixmesh.engine.models.layers import Linear
from radixmesh.engine.scheduler import gemm_warmup
from radixmesh.engine.scheduler.gemm_warmup import distinct_projections, gemm_rows, warm_up_gemms

from .scheduler_factory import make_scheduler


def test_the_ladder_is_fine_below_256_coarser_above_and_ends_at_the_top() -> None:
    rows = gemm_rows(4096)
    assert rows[:3] == [2, 3, 4] and rows[-1] == 4096 and rows == sorted(set(rows))
    assert all(b - a == 1 for a, b in pairwise(rows) if b <= 256)
    assert all(b - a == 4 for a, b in pairwise(rows) if a > 256 and b <= 1024)
    assert all(b - a <= 8 for a, b in pairwise(rows))
    assert len(rows) == 255 + 192 + 384
    assert gemm_rows(1) == [] and gemm_rows(2) == [2] and gemm_rows(300)[-1] == 300
    assert gemm_rows(263)[-3:] == [256, 260, 263]


def test_one_layer_stands_for_each_projection_kind() -> None:
    sched, _ = make_scheduler()
    model = sched.runner.model
    kinds = distinct_projections(model)
    shapes = sorted((layer.in_features, layer.out_features) for layer in kinds)
    # tiny Llama: q/k/v 32 -> 64 (4 + 2 * 2 heads of 8), o 32 -> 32, gate/up 32 -> 128, down 64 -> 32, LM head 32 -> 101
    assert shapes == [(32, 32), (32, 64), (32, 101), (32, 128), (64, 32)]
    assert all(any(k is m for m in model.modules()) for k in kinds)


def test_every_kind_runs_at_every_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    sched, _ = make_scheduler()
    seen: list[tuple[int, int, int]] = []
    real = Linear._project

    def record(layer: Linear, x: torch.Tensor, lora_epilogue: Any = None) -> torch.Tensor:
        seen.append((layer.in_features, layer.out_features, x.shape[0]))
        assert x.shape[1] == layer.in_features
        return real(layer, x, lora_epilogue)

    monkeypatch.setattr(gemm_warmup.Linear, "_project", record)
    calls, seconds = warm_up_gemms(sched.runner.model, 20, torch.float32, torch.device("cpu"))
    assert calls == len(seen) == 5 * 19 and seconds >= 0
    assert {n for _, _, n in seen} == set(range(2, 21))


def test_the_lm_head_stops_at_head_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    sched, _ = make_scheduler()
    model = sched.runner.model
    seen: list[tuple[bool, int]] = []
    real = Linear._project

    def record(layer: Linear, x: torch.Tensor, lora_epilogue: Any = None) -> torch.Tensor:
        seen.append((layer is model.lm_head, x.shape[0]))
        return real(layer, x, lora_epilogue)

    monkeypatch.setattr(gemm_warmup.Linear, "_project", record)
    monkeypatch.setattr(gemm_warmup, "HEAD_ROWS", 8)
    calls, _ = warm_up_gemms(model, 20, torch.float32, torch.device("cpu"))
    assert max(n for is_head, n in seen if is_head) == 8 and max(n for is_head, n in seen if not is_head) == 20
    assert calls == 4 * 19 + 7
