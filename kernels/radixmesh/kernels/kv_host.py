"""Token-major KV copies between the device pool and a staging buffer, for the hierarchical cache.

`gather_kv_tokens` packs the KV of given pool slots as `[num_tokens, num_layers, 2, kv_heads, head_dim]`
(the host tier's layout: a run of consecutive host slots is one contiguous block, one DMA);
`scatter_kv_tokens` writes such a buffer back into given slots. One launch per layer copies every token
of that layer (K and V); there is no loop over tokens on the host. `kv_host_ref` does the same with
PyTorch indexing (the CPU path and the tests' reference).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import check_device, next_power_of_2
from radixmesh.kernels.kv_host_ref import check_token_major_args

_TILE_ELEMS = 4096
"""Elements of one program's tile: enough heads per program to keep the copy wide."""


@triton.jit
def _copy_rows_kernel(
    pool_k_ptr, pool_v_ptr, packed_ptr, slots_ptr,
    stride_pool_row, stride_pool_head, stride_packed_tok, stride_packed_head, v_offset,
    num_kv_heads, head_dim,
    GATHER: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # packed_ptr points at [token 0, this layer, K]; V of the same token and layer sits `v_offset` further.
    tok = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    pool_off = slot * stride_pool_row + offs_h[:, None] * stride_pool_head + offs_d[None, :]
    packed_off = tok.to(tl.int64) * stride_packed_tok + offs_h[:, None] * stride_packed_head + offs_d[None, :]
    if GATHER:
        tl.store(packed_ptr + packed_off, tl.load(pool_k_ptr + pool_off, mask=mask), mask=mask)
        tl.store(packed_ptr + v_offset + packed_off, tl.load(pool_v_ptr + pool_off, mask=mask), mask=mask)
    else:
        tl.store(pool_k_ptr + pool_off, tl.load(packed_ptr + packed_off, mask=mask), mask=mask)
        tl.store(pool_v_ptr + pool_off, tl.load(packed_ptr + v_offset + packed_off, mask=mask), mask=mask)


def _launch(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], slots: torch.Tensor,
            packed: torch.Tensor, gather: bool) -> None:
    device = k_buffers[0].device
    for name, t in (("k_buffers[0]", k_buffers[0]), ("slots", slots), ("packed", packed)):
        check_device(name, t, device)
    num_tokens = slots.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = k_buffers[0].shape[1], k_buffers[0].shape[2]
    block_d = next_power_of_2(head_dim)
    block_h = min(next_power_of_2(num_kv_heads), max(1, _TILE_ELEMS // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    v_offset = packed.stride(2)
    for layer, (pool_k, pool_v) in enumerate(zip(k_buffers, v_buffers)):
        rows = packed[:, layer, 0]  # [num_tokens, kv_heads, head_dim], token stride num_layers * 2 * heads * dim
        _copy_rows_kernel[grid](
            pool_k, pool_v, rows, slots,
            pool_k.stride(0), pool_k.stride(1), rows.stride(0), rows.stride(1), v_offset,
            num_kv_heads, head_dim,
            GATHER=gather, BLOCK_H=block_h, BLOCK_D=block_d,
        )


def gather_kv_tokens(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], slots: torch.Tensor,
                     out: torch.Tensor) -> None:
    """`out[t, l, 0|1] = k|v_buffers[l][slots[t]]`; `out` `[num_tokens, num_layers, 2, kv_heads, head_dim]`,
    contiguous, the pool's dtype; `slots` `[num_tokens]` int32/int64 on the pool's device."""
    check_token_major_args(k_buffers, v_buffers, slots, out, "out")
    _launch(k_buffers, v_buffers, slots, out, gather=True)


def scatter_kv_tokens(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], slots: torch.Tensor,
                      src: torch.Tensor) -> None:
    """`k|v_buffers[l][slots[t]] = src[t, l, 0|1]`: the inverse of `gather_kv_tokens` (slots distinct)."""
    check_token_major_args(k_buffers, v_buffers, slots, src, "src")
    _launch(k_buffers, v_buffers, slots, src, gather=False)
