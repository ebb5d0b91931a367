"""LoRA in the model runner: the slot buffers, and which slot each row of a pass uses.

Before every eager pass `prepare` reads each request's slot (`Req.lora_slot`, -1 for the base model): per
row in a decode step, per request segment of rows in a prefill pass. A decode CUDA graph is captured over a
static per-row slot buffer (`bind_graph`) that each replay fills first (`stage_graph`), so one graph serves
any mix of adapters; a second graph of the same size without the adapters' launches serves batches of base
requests only.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixmesh.engine.device_io import copy_to_device
from radixmesh.engine.distributed.layout import ShardLayout
from radixmesh.engine.lora.adapter import LoraAdapter
from radixmesh.engine.lora.layers import row_runs
from radixmesh.engine.lora.slots import LoraSlots, SlotShape

if TYPE_CHECKING:
    from radixmesh.engine.batch import ScheduleBatch


class LoraRuntime:
    """The model's adapter slots and the per-pass slot choice."""

    def __init__(self, model: nn.Module, layout: ShardLayout, hidden: int, shape: SlotShape, device: torch.device,
                 dtype: torch.dtype, max_graph_bs: int = 0) -> None:
        self.slots = LoraSlots(model, layout, hidden, shape, device, dtype)
        self.device = device
        self.graph_slots = torch.full((max(max_graph_bs, 1),), -1, dtype=torch.int32, device=device)
        """[max graph batch] int32: the slot of each row of a decode graph replay."""
        self.mirror: Callable[[int, str, str | None], None] | None = None
        """Tensor parallelism on rank 0: tells the other ranks of every slot write (`TpLeader.lora_slot`)."""

    @property
    def state(self):
        return self.slots.state

    def set_overlap(self, mode: str) -> None:
        """When the shrink runs beside the base GEMM (--lora-overlap); on CUDA the side stream is made now, before
        any graph is captured."""
        self.state.overlap = mode
        if self.device.type == "cuda" and mode != "off":
            from radixmesh.kernels.lora_overlap import side_stream

            side_stream(self.device)

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Load `adapter` into `slot` on every rank (the scheduler keeps running requests off slots it rewrites)."""
        if self.mirror is not None:
            self.mirror(slot, adapter.name, adapter.path)
        self.slots.write(slot, adapter)

    def clear(self, slot: int) -> None:
        if self.mirror is not None:
            self.mirror(slot, "", None)
        self.slots.clear(slot)

    def prepare(self, batch: ScheduleBatch) -> None:
        """Set the slot of every row of an eager pass of `batch`."""
        req_slots = [req.lora_slot for req in batch.reqs]
        self.prepare_rows(req_slots, None if batch.is_decode else list(batch.extend_lens))

    def prepare_rows(self, req_slots: list[int], extend_lens: list[int] | None) -> None:
        """Each request's slot; `extend_lens`: its rows in a prefill pass (None: one row each, decode)."""
        state = self.state
        state.active = any(s >= 0 for s in req_slots)
        if not state.active:
            return
        if self.device.type != "cuda":
            rows = req_slots if extend_lens is None else [s for s, n in zip(req_slots, extend_lens) for _ in range(n)]
            state.runs = row_runs(rows)
            return
        from radixmesh.kernels.lora import LoraBatch

        slots = torch.tensor(req_slots, dtype=torch.int32).to(self.device, non_blocking=True)
        if extend_lens is None:
            state.kernel_batch = LoraBatch.per_row(slots)
        else:
            starts = torch.tensor([0, *accumulate(extend_lens)], dtype=torch.int32).to(self.device, non_blocking=True)
            state.kernel_batch = LoraBatch(slots, starts, max(max(extend_lens), 1))

    def bind_graph(self, bs: int, with_lora: bool = True) -> None:
        """A decode graph of `bs` rows being captured reads the static slot buffer (`with_lora`), or launches
        nothing for adapters (a graph for batches of base requests)."""
        from radixmesh.kernels.lora import LoraBatch

        self.state.active = with_lora
        self.state.kernel_batch = LoraBatch.per_row(self.graph_slots[:bs]) if with_lora else None

    def stage_graph(self, req_slots: list[int], padded_bs: int) -> None:
        """Fill the static slot buffer for a replay of `padded_bs` rows (padding rows use none)."""
        copy_to_device(self.graph_slots[:padded_bs], [*req_slots, *([-1] * (padded_bs - len(req_slots)))])
