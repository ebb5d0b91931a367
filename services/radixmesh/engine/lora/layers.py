"""The LoRA side of a linear layer: adds each row's adapter output to the base layer's output.

A `Linear` with a `LoraProjection` (its `lora` attribute) computes `y = x @ W.T` and then `y += scaling_s *
x @ A_s.T @ B_s.T` for every row whose request uses the adapter in slot s. On CUDA that is the batched
shrink/expand kernels of `radixmesh.kernels.lora` (Punica/S-LoRA style, CUDA-graph capturable); elsewhere
plain matmuls over the batch's runs of rows sharing a slot. Which slot each row uses is the one
`LoraBatchState` of the model, set by the runner before every pass. At one row where the GEMV kernels run,
"auto" and "epilogue" give the GEMV the adapter instead (`epilogue`): one shrink launch, the expand in the
GEMV's epilogue (`radixmesh.kernels.lora_gemv`). At more rows on CUDA the shrink may run on a side stream while
the base GEMM runs, the expand after both (`project`, --lora-overlap: `radixmesh.kernels.lora_overlap`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from radixmesh.engine.lora.overlap import expands_on_side, may_overlap


@dataclass
class LoraBatchState:
    """Which adapter slot the rows of the current pass use (shared by every LoRA projection of a model)."""

    ranks: torch.Tensor
    """[num_slots] int32 on the device: each slot's rank (0: empty)."""
    scalings: torch.Tensor
    """[num_slots] float32 on the device."""
    ranks_host: list[int]
    """Host copy of `ranks` (the matmul path sizes its products with it)."""
    scalings_host: list[float]
    """Host copy of `scalings`."""
    active: bool = False
    """Some row of the pass uses an adapter (else the projections add nothing)."""
    kernel_batch: Any = None
    """CUDA: the `radixmesh.kernels.lora.LoraBatch` of the pass (per row or per segment)."""
    runs: list[tuple[int, int, int]] = field(default_factory=list)
    """Matmul path: (slot, first row, end row) of the pass's runs of rows with an adapter."""
    kernels: str = "auto"
    """CUDA: the decode kernel set (--lora-kernels, `radixmesh.kernels.lora.KERNELS`)."""
    overlap: str = "auto"
    """CUDA: when the shrink runs beside the base GEMM (--lora-overlap, `radixmesh.engine.lora.overlap`)."""

    def one_row(self, x: torch.Tensor) -> bool:
        """A pass of one row on CUDA whose slot is `kernel_batch.slots[0]`."""
        return (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and self.kernel_batch is not None
                and self.kernel_batch.num_segments == 1)


class LoraProjection:
    """The adapter slots of one (possibly stacked) projection: `a` [num_slots, num_slices * R, in_local] and
    `b` [num_slots, out_local, R], slice i's B in the rows of its output columns (`radixmesh.kernels.lora`)."""

    def __init__(self, state: LoraBatchState, a: torch.Tensor, b: torch.Tensor,
                 slice_sizes: tuple[int, ...]) -> None:
        assert a.shape[1] % len(slice_sizes) == 0 and b.shape[1] == sum(slice_sizes), (
            f"a {tuple(a.shape)} / b {tuple(b.shape)} do not fit slices {slice_sizes}")
        self.state, self.a, self.b, self.slice_sizes = state, a, b, slice_sizes
        self.max_rank = b.shape[2]

    @property
    def active(self) -> bool:
        """Some row of the current pass uses an adapter (else the layer runs as without LoRA)."""
        return self.state.active

    def fuses_prologue(self, x: torch.Tensor) -> bool:
        """Whether a pass with adapters may keep the batch-1 GEMV's fused norm prologue for input `x`: the adapter
        then comes in the GEMV's epilogue (`takes_epilogue`), or as an addend (`norm_delta`) computed with the norm
        ("grouped" or "fused" kernels)."""
        return self.state.one_row(x) and self.state.kernels in ("grouped", "fused", "auto", "epilogue")

    def takes_epilogue(self, x: torch.Tensor) -> bool:
        """Whether a GEMV of one row `x` adds the adapter in its epilogue ("auto" and "epilogue" kernels)."""
        return self.state.one_row(x) and self.state.kernels in ("auto", "epilogue")

    def epilogue(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 norm_weight: torch.Tensor | None = None) -> Any:
        """The shrink of one row `x` (of `(x + residual) * norm_weight` with a norm) for the GEMV's epilogue: a
        `radixmesh.kernels.lora_gemv.LoraEpilogue`."""
        from radixmesh.kernels.lora_gemv import lora_gemv_shrink

        state = self.state
        return lora_gemv_shrink(x, self.a, self.b, state.kernel_batch.slots, state.ranks, state.scalings,
                                self.slice_sizes, residual, norm_weight)

    def norm_delta(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
        """float32 `[1, out]`: the row's adapter output on `rmsnorm(x + residual) * norm_weight`, for the fused
        GEMV to add before its epilogue (`radixmesh.kernels.lora_prologue`)."""
        from radixmesh.kernels.lora_prologue import lora_norm_delta

        state = self.state
        return lora_norm_delta(x, residual, norm_weight, eps, self.a, self.b, state.kernel_batch.slots, state.ranks,
                               state.scalings, self.slice_sizes)

    def project(self, x: torch.Tensor, base: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`base(x)` (the base layer's output) plus the rows' adapter outputs: on CUDA where `overlap_kind` says so,
        the shrink on the side stream while `base` runs; else `add` after it."""
        kind = self.overlap_kind(x)
        if kind is None:
            return self.add(x, base(x))
        from radixmesh.kernels.lora_overlap import lora_overlapped

        state = self.state
        return lora_overlapped(x.contiguous(), base, self.a, self.b, state.kernel_batch, state.ranks, state.scalings,
                               self.slice_sizes, kind, expand_on_side=expands_on_side(state.overlap))

    def overlap_kind(self, x: torch.Tensor) -> str | None:
        """The kernel set ("rows" or "grouped") whose shrink runs beside the base GEMM for input `x` of a pass with
        adapters (`radixmesh.engine.lora.overlap.may_overlap`), or None where the adapters run after it."""
        state = self.state
        if not (state.active and x.is_cuda and state.overlap != "off" and state.kernel_batch is not None):
            return None
        from radixmesh.kernels.lora import choose_kernels

        batch = state.kernel_batch
        kind = choose_kernels(state.kernels, batch, self.max_rank)
        return kind if may_overlap(state.overlap, kind, batch.seg_starts is not None, x.shape[0]) else None

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base output of `x`) plus the rows' adapter outputs, in place."""
        state = self.state
        if not state.active or x.shape[0] == 0:
            return y
        if x.is_cuda:
            from radixmesh.kernels.lora import lora_apply

            return lora_apply(x.contiguous(), y, self.a, self.b, state.kernel_batch, state.ranks, state.scalings,
                              self.slice_sizes, kernels=state.kernels)
        return self._add_matmul(x, y)

    def _add_matmul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        state, big_r = self.state, self.max_rank
        for slot, start, end in state.runs:
            rank, scaling = state.ranks_host[slot], state.scalings_host[slot]
            xs = x[start:end]  # [rows, in]
            col = 0
            for i, size in enumerate(self.slice_sizes):
                xa = xs @ self.a[slot, i * big_r:i * big_r + rank].t()  # [rows, rank]
                y[start:end, col:col + size] += scaling * (xa @ self.b[slot, col:col + size, :rank].t())
                col += size
        return y


def row_runs(row_slots: list[int]) -> list[tuple[int, int, int]]:
    """(slot, first row, end row) of each run of consecutive rows sharing a slot >= 0."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for row in range(1, len(row_slots) + 1):
        if row == len(row_slots) or row_slots[row] != row_slots[start]:
            if row_slots[start] >= 0:
                runs.append((row_slots[start], start, row))
            start = row
    return runs
