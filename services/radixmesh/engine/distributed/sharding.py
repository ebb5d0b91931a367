"""How a model is cut across tensor-parallel ranks, and the group handle the sharded layers use.

Column-parallel layers (q/k/v, gate/up, the LM head) keep a contiguous block of output rows on
each rank; row-parallel layers (o, down) keep the matching block of input columns and sum the
ranks' partial outputs with one all-reduce. The embedding and LM head split the vocabulary
(rows padded up to a multiple of the TP size). KV heads split like query heads; when there are
fewer KV heads than ranks each rank keeps the one KV head its query heads read (replicated).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from radixmesh.engine.distributed.layout import VOCAB_MODULES, ShardLayout


class Communicator(Protocol):
    """Collectives over the ranks of one tensor-parallel group (every rank calls them in the same order)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place; returns `x`."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """`[size, *x.shape]`: every rank's `x`, in rank order."""
        ...

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `x` with rank `src`'s `x` in place; returns `x`."""
        ...

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (every rank gets it)."""
        ...

    def all_to_all(self, x: torch.Tensor, send_rows: list[int], recv_rows: list[int]) -> torch.Tensor:
        """Rows `x[sum(send_rows[:j]) : ... + send_rows[j]]` go to rank j; returns the rows received, rank by rank
        (`sum(recv_rows)` of them: `recv_rows[i]` from rank i)."""
        ...

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[size * m, ...]` summed over the ranks; rank r gets block r `[m, ...]` of the sum."""
        ...


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its tensor-parallel group (rank 0 of 1 without TP) and its collectives."""

    rank: int = 0
    """This process's rank, 0..size-1; rank 0 runs the scheduler."""
    size: int = 1
    """Ranks in the group (`--tp-size`)."""
    comm: Communicator | None = field(default=None, compare=False, repr=False)
    """The group's collectives; None without TP (or for building a rank's weights offline)."""
    ep_size: int = 1
    """Ranks the experts of MoE layers are spread over (`--ep-size`: 1, or all ranks of the group)."""
    dp_attention: bool = False
    """Data-parallel attention (`--enable-dp-attention`): each rank holds whole attention weights and runs only its
    own requests; the MLPs run over every rank's tokens (`distributed.dp_attention`)."""

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size, f"rank {self.rank} outside a group of {self.size}"
        assert self.ep_size in (1, self.size), f"ep_size {self.ep_size}: 1 or the group's size {self.size}"
        assert not self.dp_attention or self.ep_size == self.size > 1, "data-parallel attention needs EP = TP > 1"

    @property
    def attention_tp(self) -> TensorParallel:
        """The group attention, the embedding and the LM head are split over: none under data-parallel attention."""
        return TP_NONE if self.dp_attention else self

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        assert self.comm is not None, "a sharded layer ran without a communicator"
        return self.comm.all_reduce(x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x.unsqueeze(0)
        assert self.comm is not None, "a sharded layer ran without a communicator"
        return self.comm.all_gather(x)

    def all_to_all(self, x: torch.Tensor, send_rows: list[int], recv_rows: list[int]) -> torch.Tensor:
        if self.size == 1:
            return x
        assert self.comm is not None, "a sharded layer ran without a communicator"
        return self.comm.all_to_all(x, send_rows, recv_rows)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        assert self.comm is not None, "a sharded layer ran without a communicator"
        return self.comm.reduce_scatter(x)


TP_NONE = TensorParallel()


class RankLink(Protocol):
    """A rank's place in its group at startup: its `TensorParallel`, and the handshake of its stages
    (rank 0 waits until every other rank reported a stage; the others report it)."""

    @property
    def tp(self) -> TensorParallel: ...

    def stage(self, stage: str) -> None: ...

class WeightSource(Protocol):
    """A checkpoint tensor, or a lazy handle that reads only the slice asked for (a torch.Tensor is one)."""

    @property
    def shape(self) -> Any: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...


def take_shard(layout: ShardLayout, name: str, source: WeightSource,
               dest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of checkpoint tensor `name` and the part of `dest` it fills.

    Vocabulary rows beyond the real ones (padding up to a multiple of the TP size) stay untouched:
    the vocabulary-parallel layers zero them when built.
    """
    cut = layout.checkpoint_slice(name)
    if cut is None:
        return _whole(source), dest
    dim, start, length = cut
    if dim >= len(source.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(source.shape)}; tensor parallelism splits its dim {dim}")
    if start + length > source.shape[dim]:
        raise ValueError(f"weight {name!r} has shape {tuple(source.shape)}; this rank needs "
                         f"[{start}, {start + length}) of dim {dim}")
    if name.rpartition(".")[0].endswith(VOCAB_MODULES) and dest.shape[0] > length:
        dest = dest.narrow(0, 0, length)  # the padding rows
    return source.narrow(dim, start, length), dest


def _whole(source: WeightSource) -> torch.Tensor:
    if isinstance(source, torch.Tensor):
        return source
    return source.narrow(0, 0, source.shape[0])
