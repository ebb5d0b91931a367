"""The KV pool of a tensor-parallel worker as KV transports see it: every KV head of the model.

Each rank holds its KV heads' shard of every slot. A transport's gather (prefill side) collects
the shards of the asked slots from all ranks on rank 0 in the whole model's head order; its
scatter (decode side) broadcasts whole-model KV and each rank keeps its heads. On the wire a
TP worker's KV is therefore the same as a single-GPU worker's: prefill and decode workers may
run different TP sizes. (A transport per rank would move less through rank 0; see the doc.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixmesh.engine.disagg import kv_io
from radixmesh.engine.distributed.layout import ShardLayout
from radixmesh.engine.distributed.messages import KVGatherMsg, KVScatterMsg
from radixmesh.engine.distributed.sharding import Communicator
from radixmesh.engine.memory import TokenToKVPool

if TYPE_CHECKING:
    from radixmesh.engine.distributed.leader import TpLeader


class ShardedKVPool(TokenToKVPool):
    """Rank 0's whole-model view of the ranks' KV shards (for `kv_io.gather`/`scatter` only)."""

    def __init__(self, local: TokenToKVPool, leader: TpLeader) -> None:  # no buffers of its own
        self.local, self.leader, self.layout = local, leader, leader.layout
        self._size = local.size
        self.num_layers, self.head_dim = local.num_layers, local.head_dim
        self.num_kv_heads = leader.layout.total_kv_heads
        self.dtype, self.device = local.dtype, local.device
        # nothing may index this view's buffers directly
        self.k_buffers: list[torch.Tensor] = []
        self.v_buffers: list[torch.Tensor] = []

    def gather(self, slots: torch.Tensor, out: torch.Tensor, layer_begin: int = 0) -> None:
        """`out` `[layers, 2, tokens, all kv heads, head_dim]` from every rank's shard at `slots`."""
        if slots.shape[0] == 0:
            return
        self.leader.kv_command(KVGatherMsg(int(slots.shape[0]), layer_begin, int(out.shape[0])), slots)
        assert self.leader.comm is not None
        parts = gather_shards(self.local, self.leader.comm, slots, int(out.shape[0]), layer_begin)
        heads = self.local.num_kv_heads
        for i, rank in enumerate(self.layout.kv_source_ranks()):
            out[:, :, :, i * heads:(i + 1) * heads].copy_(parts[rank])

    def scatter(self, slots: torch.Tensor, src: torch.Tensor, layer_begin: int = 0) -> None:
        """Write whole-model KV `src` into `slots`: each rank keeps its heads."""
        if slots.shape[0] == 0:
            return
        self.leader.kv_command(KVScatterMsg(int(slots.shape[0]), layer_begin, int(src.shape[0])), slots)
        assert self.leader.comm is not None
        src = self.leader.comm.broadcast(src.to(self.device).contiguous())
        scatter_own_heads(self.local, self.layout, slots, src, layer_begin)


def gather_shards(local: TokenToKVPool, comm: Communicator, slots: torch.Tensor, num_layers: int,
                  layer_begin: int) -> torch.Tensor:
    """Every rank's KV at `slots`: `[ranks, layers, 2, tokens, local kv heads, head_dim]` (all ranks call it)."""
    shard = torch.empty(kv_io.packed_shape(local, num_layers, int(slots.shape[0])), dtype=local.dtype,
                        device=local.device)
    kv_io.gather(local, slots, shard, layer_begin)
    return comm.all_gather(shard)


def scatter_own_heads(local: TokenToKVPool, layout: ShardLayout, slots: torch.Tensor, src: torch.Tensor,
                      layer_begin: int) -> None:
    """This rank's KV heads of whole-model KV `src` `[layers, 2, tokens, all kv heads, head_dim]` into `slots`."""
    begin = layout.kv_head_begin
    mine = src[:, :, :, begin:begin + layout.num_kv_heads].contiguous()
    kv_io.scatter(local, slots, mine, layer_begin)
