"""Tensor-parallel layers: row-parallel linear (one all-reduce), vocabulary-parallel embedding and LM head.

Column-parallel layers need no class of their own: a `Linear` holding this rank's output rows
(`ShardLayout` says which) is one. Every layer here is plain device work plus collectives, so a
decode step captures into a CUDA graph with its all-reduces inside.
"""

from __future__ import annotations

import torch
from torch import nn

from radixmesh.engine.distributed.layout import ShardLayout
from radixmesh.engine.distributed.sharding import TensorParallel
from radixmesh.engine.models.layers import Linear, Prologue


class RowParallelLinear(Linear):
    """`Linear` over this rank's input columns; the ranks' partial outputs are summed (one all-reduce)."""

    def __init__(self, in_features_local: int, out_features: int, tp: TensorParallel) -> None:
        super().__init__(in_features_local, out_features, bias=False)  # a bias would be added size times
        self.tp = tp

    def forward(self, x: torch.Tensor, prologue: Prologue | None = None) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x, prologue))


def row_parallel_linear(in_features_local: int, out_features: int, tp: TensorParallel) -> Linear:
    """A row-parallel layer, or a plain bias-free `Linear` without TP."""
    if not tp.enabled:
        return Linear(in_features_local, out_features, bias=False)
    return RowParallelLinear(in_features_local, out_features, tp)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows `[vocab_begin, vocab_begin + vocab_rows)` of the vocabulary on this rank.

    Each rank looks up the ids it holds (zeros for the others) and one all-reduce sums them.
    """

    def __init__(self, layout: ShardLayout, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(layout.vocab_rows, hidden_size))  # [vocab_rows, hidden]
        self.begin, self.valid = layout.vocab_begin, layout.vocab_valid
        self.tp = tp

    def init_buffers(self) -> None:
        """Zero the padding rows (no checkpoint fills them)."""
        _zero_padding(self.weight, self.valid)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.begin
        held = (local >= 0) & (local < self.valid)  # [num_tokens]
        out = nn.functional.embedding(local.masked_fill(~held, 0), self.weight)  # [num_tokens, hidden]
        out.masked_fill_(~held.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(Linear):
    """LM head over this rank's vocabulary rows; the ranks' logits are gathered (one all-gather) and the
    padding rows dropped, so every rank returns the whole `[num_tokens, vocab]`."""

    def __init__(self, layout: ShardLayout, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        super().__init__(hidden_size, layout.vocab_rows, bias=False)
        self.vocab_size, self.valid = vocab_size, layout.vocab_valid
        self.tp = tp

    def init_buffers(self) -> None:
        """Zero the padding rows (no checkpoint fills them)."""
        _zero_padding(self.weight, self.valid)

    def forward(self, x: torch.Tensor, prologue: Prologue | None = None) -> torch.Tensor:
        local = super().forward(x, prologue)  # [num_tokens, vocab_rows]
        parts = self.tp.all_gather(local.contiguous())  # [size, num_tokens, vocab_rows]
        whole = parts.permute(1, 0, 2).reshape(local.shape[0], -1)  # [num_tokens, size * vocab_rows]
        return whole[:, : self.vocab_size]


def _zero_padding(weight: torch.Tensor, valid_rows: int) -> None:
    if weight.device.type != "meta" and valid_rows < weight.shape[0]:
        with torch.no_grad():
            weight[valid_rows:].zero_()
