"""Gather a pool's KV at given slots into a contiguous buffer, and scatter one back: Triton kernels on
CUDA, PyTorch indexing elsewhere. Layout `[num_layers, 2, num_tokens, kv_heads, head_dim]`."""

from __future__ import annotations

import torch

from radixmesh.engine.memory import TokenToKVPool
from radixmesh.kernels.kv_transfer_ref import gather_kv_torch, scatter_kv_torch


def packed_shape(pool: TokenToKVPool, num_layers: int, num_tokens: int) -> tuple[int, int, int, int, int]:
    return (num_layers, 2, num_tokens, pool.num_kv_heads, pool.head_dim)


def gather(pool: TokenToKVPool, slots: torch.Tensor, out: torch.Tensor, layer_begin: int = 0) -> None:
    """`out[i] = (K, V)` of layer `layer_begin + i` at `slots`, for every layer of `out`."""
    from radixmesh.engine.distributed.kv_pool import ShardedKVPool

    if isinstance(pool, ShardedKVPool):  # tensor parallelism: every rank's KV heads
        pool.gather(slots, out, layer_begin)
    elif pool.device.type == "cuda":
        from radixmesh.kernels.kv_transfer import gather_kv

        gather_kv(pool.k_buffers, pool.v_buffers, slots, out, layer_begin)
    else:
        gather_kv_torch(pool.k_buffers, pool.v_buffers, slots, out, layer_begin)


def scatter(pool: TokenToKVPool, slots: torch.Tensor, src: torch.Tensor, layer_begin: int = 0) -> None:
    """Write `src[i]` (K, V of layer `layer_begin + i`) into the pool at `slots`."""
    from radixmesh.engine.distributed.kv_pool import ShardedKVPool

    if isinstance(pool, ShardedKVPool):  # tensor parallelism: each rank keeps its KV heads
        pool.scatter(slots, src, layer_begin)
    elif pool.device.type == "cuda":
        from radixmesh.kernels.kv_transfer import scatter_kv

        scatter_kv(pool.k_buffers, pool.v_buffers, slots, src, layer_begin)
    else:
        scatter_kv_torch(pool.k_buffers, pool.v_buffers, slots, src, layer_begin)
