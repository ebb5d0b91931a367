"""Data-parallel attention: each rank attends over its own requests; the MLP layers run over every rank's tokens.

Under `--enable-dp-attention` (with `--ep-size` = `--tp-size`) every rank holds the whole attention, embedding and
LM head, and runs a pass over its own share of the batch only (`distributed.dp_batch`), its KV in its own pool.
Around each MLP the ranks' tokens meet: every rank's normed hidden rows are all-gathered (padded to the longest
rank's count), each rank runs its experts (or its slice of a dense MLP) on all of them, and one reduce-scatter
sums the ranks' partial outputs and hands each rank back its own rows. An MoE layer whose pass dispatches by
all-to-all skips the gather: each rank sends its own tokens to their experts' ranks (`moe_dispatch.exchange`).
The LM head's rows are gathered the same way, in the whole batch's order, for rank 0 to sample.

Every rank knows every rank's counts from the batch rank 0 broadcast (`DpPass`), so no collective exchanges
sizes, and a rank without requests in a pass still joins every gather and reduce-scatter with zero rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from radixmesh.engine.distributed.sharding import TensorParallel


@dataclass(frozen=True)
class DpPass:
    """The shape of one pass over the ranks (the same on every rank)."""

    num_tokens: tuple[int, ...]
    """Tokens of each rank's share of the batch."""
    num_rows: tuple[int, ...]
    """Rows whose logits each rank's share returns (its requests' last tokens, then its prompt log-prob rows)."""
    row_order: tuple[int, ...]
    """For each logit row of the whole batch (requests in batch order, then the prompt log-prob rows in the plan's
    order), its place among the ranks' rows put one after the other in rank order."""


class DpAttention:
    """The token exchange of one model's layers; `begin` sets each pass's counts before the model runs."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp
        self.plan: DpPass | None = None
        self._index: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}

    def begin(self, plan: DpPass) -> None:
        assert len(plan.num_tokens) == self.tp.size, f"a pass over {len(plan.num_tokens)} ranks in {self.tp.size}"
        self.plan = plan
        self._index.clear()

    @property
    def _plan(self) -> DpPass:
        assert self.plan is not None, "a data-parallel attention pass ran without `begin`"
        return self.plan

    def mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`mlp`'s output for this rank's normed rows `x` `[n, hidden]` (see the module docstring)."""
        counts = self._plan.num_tokens
        dispatch_own = getattr(mlp, "dispatch_own", None)  # (MoE blocks: all-to-all of this rank's tokens)
        if dispatch_own is not None:
            out: torch.Tensor | None = dispatch_own(x, sum(counts))
            if out is not None:
                return out
        return self.scatter(mlp(self.gather(x, counts)), counts)

    def gather(self, x: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
        """Every rank's rows `[sum(counts), ...]`, rank after rank (`x`: this rank's `counts[rank]` rows)."""
        assert x.shape[0] == counts[self.tp.rank], f"{x.shape[0]} rows; this pass gives rank {self.tp.rank} " \
                                                   f"{counts[self.tp.rank]}"
        most = max(counts)
        if most == 0:
            return x
        padded = x.new_zeros(most, *x.shape[1:])
        padded[:x.shape[0]] = x
        every = self.tp.all_gather(padded).reshape(self.tp.size * most, *x.shape[1:])  # [ranks * most, ...]
        return every.index_select(0, self._valid(counts, x.device))

    def scatter(self, y: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
        """The sum over the ranks of `y` `[sum(counts), ...]` (each rank's partial output for every rank's rows), this
        rank's rows of it."""
        most = max(counts)
        if most == 0:
            return y
        padded = y.new_zeros(self.tp.size * most, *y.shape[1:])
        padded.index_copy_(0, self._valid(counts, y.device), y)
        return self.tp.reduce_scatter(padded)[:counts[self.tp.rank]]

    def logit_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The hidden rows the LM head reads, every rank's, in the whole batch's order (`rows`: this rank's)."""
        plan = self._plan
        every = self.gather(rows, plan.num_rows)
        order = torch.tensor(plan.row_order, dtype=torch.int64).to(rows.device, non_blocking=True)
        return every.index_select(0, order)

    def _valid(self, counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """Rows of the padded gather that hold real rows: `rank * max(counts) + i` for `i < counts[rank]`."""
        key = (counts, device)
        index = self._index.get(key)
        if index is None:
            most = max(counts)
            rows = [r * most + i for r, n in enumerate(counts) for i in range(n)]
            index = self._index[key] = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        return index
