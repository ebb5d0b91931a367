"""The adapters' slot buffers on the device, one set per projection of every layer, and how an adapter is
written into a slot (this rank's shard of it under tensor parallelism).

Stacked projections keep their checkpoint slices: q/k/v are three slices of `qkv_proj`, gate/up two of
`gate_up_proj`. Under TP an adapter is sharded like its layer: B of a column-parallel projection (q/k/v,
gate/up) along its output rows, A of a row-parallel one (o, down) along its input columns, whose partial
products the layer's all-reduce sums with the base output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from radixmesh.engine.distributed.layout import ShardLayout
from radixmesh.engine.lora.adapter import LoraAdapter
from radixmesh.engine.lora.layers import LoraBatchState, LoraProjection

GROUPS: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                                      "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
"""Model projection -> the checkpoint projections stacked in it (LoRA slices)."""


@dataclass(frozen=True)
class SlotShape:
    """Slot buffer sizes of the model."""

    num_slots: int
    """Adapters on the device at once (--max-loras-per-batch)."""
    max_rank: int
    """R: the largest rank a slot holds (--max-lora-rank)."""
    targets: tuple[str, ...]
    """Projections with buffers (--lora-target-modules)."""


def _local_sizes(layout: ShardLayout, hidden: int, group: str) -> tuple[int, tuple[int, ...]]:
    """(in features, slice sizes) of this rank's part of projection `group`."""
    d = layout.head_dim
    q, kv, inter = layout.num_heads * d, layout.num_kv_heads * d, layout.intermediate_size
    return {"qkv_proj": (hidden, (q, kv, kv)), "o_proj": (q, (hidden,)),
            "gate_up_proj": (hidden, (inter, inter)), "down_proj": (inter, (hidden,))}[group]


class LoraSlots:
    """Every LoRA projection of a decoder model, with its buffers, and the shared batch state."""

    def __init__(self, model: nn.Module, layout: ShardLayout, hidden: int, shape: SlotShape,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.layout, self.shape = layout, shape
        n = shape.num_slots
        self.state = LoraBatchState(torch.zeros(n, dtype=torch.int32, device=device),
                                    torch.zeros(n, dtype=torch.float32, device=device), [0] * n, [0.0] * n)
        self.projections: dict[tuple[int, str], LoraProjection] = {}
        layers: nn.ModuleList = model.model.layers  # type: ignore[union-attr,assignment]  # a decoder CausalLM
        for layer_id, layer in enumerate(layers):
            for group, modules in GROUPS.items():
                if not set(modules) & set(shape.targets):
                    continue
                in_local, sizes = _local_sizes(layout, hidden, group)
                a = torch.zeros(n, len(sizes) * shape.max_rank, in_local, dtype=dtype, device=device)
                b = torch.zeros(n, sum(sizes), shape.max_rank, dtype=dtype, device=device)
                proj = LoraProjection(self.state, a, b, sizes)
                linear = getattr(layer.self_attn if group in ("qkv_proj", "o_proj") else layer.mlp, group)
                linear.lora = proj
                self.projections[(layer_id, group)] = proj

    @property
    def num_bytes(self) -> int:
        """Device bytes of all slot buffers."""
        return sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size()
                   for p in self.projections.values())

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` (this rank's shard) into `slot`, replacing what it held."""
        big_r, rank = self.shape.max_rank, adapter.rank
        for (layer_id, group), proj in self.projections.items():
            proj.a[slot].zero_()
            proj.b[slot].zero_()
            col = 0
            for i, module in enumerate(GROUPS[group]):
                size = proj.slice_sizes[i]
                pair = adapter.weights.get((layer_id, module))
                if pair is not None:
                    a, b = self._shard(module, *pair)
                    proj.a[slot, i * big_r:i * big_r + rank].copy_(a)
                    proj.b[slot, col:col + size, :rank].copy_(b)
                col += size
        self.state.ranks[slot] = rank
        self.state.scalings[slot] = adapter.scaling
        self.state.ranks_host[slot] = rank
        self.state.scalings_host[slot] = adapter.scaling

    def clear(self, slot: int) -> None:
        """Empty `slot` (its rank 0: rows pointing at it add nothing)."""
        self.state.ranks[slot] = 0
        self.state.ranks_host[slot] = 0

    def _shard(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A, B): the weight's split dim 0 cuts B's rows, its dim 1 A's columns."""
        cut = self.layout.checkpoint_slice(f"layers.{module}.weight")
        if cut is None:
            return a, b
        dim, start, length = cut
        return (a, b.narrow(0, start, length)) if dim == 0 else (a.narrow(1, start, length), b)

    def targets_of(self, adapter: LoraAdapter) -> list[str]:
        """The adapter's targets that have no buffers here."""
        return [m for m in adapter.targets if m not in self.shape.targets]
