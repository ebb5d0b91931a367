"""KV transfer kernels: gather the KV of given pool slots into one contiguous buffer, and scatter such
a buffer into given slots (prefill/decode disaggregation moves a prompt's KV this way).

The contiguous layout is `[num_layers, 2, num_tokens, kv_heads, head_dim]` (index 0 of the second
axis is K, 1 is V), so any range of layers is one contiguous block: a transport sends layer ranges
as they are. Pool buffers are per layer `[num_slots, kv_heads, head_dim]` (page size one token).
One launch per layer copies every token of that layer; there is no loop over tokens on the host.
`kv_transfer_ref` does the same with PyTorch indexing (the CPU path and the tests' reference).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import check_device, next_power_of_2
from radixmesh.kernels.kv_transfer_ref import as_bytes, check_transfer_args

# elements of one tile: enough heads per program to keep the copy wide
_COPY_TILE_ELEMS = 4096


@triton.jit
def _copy_kv_rows_kernel(
    src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr, slots_ptr,
    stride_src_k_row, stride_src_k_head, stride_src_v_row, stride_src_v_head,
    stride_dst_k_row, stride_dst_k_head, stride_dst_v_row, stride_dst_v_head,
    num_kv_heads, head_dim,
    GATHER: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # GATHER: row `tok` of dst <- row slots[tok] of src; else row slots[tok] of dst <- row `tok` of src
    tok = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    tok64 = tok.to(tl.int64)
    if GATHER:
        src_row = slot
        dst_row = tok64
    else:
        src_row = tok64
        dst_row = slot
    k = tl.load(src_k_ptr + src_row * stride_src_k_row + offs_h[:, None] * stride_src_k_head + offs_d[None, :],
                mask=mask)
    tl.store(dst_k_ptr + dst_row * stride_dst_k_row + offs_h[:, None] * stride_dst_k_head + offs_d[None, :],
             k, mask=mask)
    v = tl.load(src_v_ptr + src_row * stride_src_v_row + offs_h[:, None] * stride_src_v_head + offs_d[None, :],
                mask=mask)
    tl.store(dst_v_ptr + dst_row * stride_dst_v_row + offs_h[:, None] * stride_dst_v_head + offs_d[None, :],
             v, mask=mask)


def _launch(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], slots: torch.Tensor,
            packed: torch.Tensor, layer_begin: int, gather: bool) -> None:
    device = k_buffers[0].device
    for name, t in (("k_buffers[0]", k_buffers[0]), ("slots", slots), ("packed", packed)):
        check_device(name, t, device)
    num_tokens = slots.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = k_buffers[0].shape[1], k_buffers[0].shape[2]
    block_d = next_power_of_2(head_dim)
    block_h = min(next_power_of_2(num_kv_heads), max(1, _COPY_TILE_ELEMS // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    packed = as_bytes(packed)  # FP8 moves as bytes: a bit copy, no conversion
    for i in range(packed.shape[0]):
        pool_k, pool_v = as_bytes(k_buffers[layer_begin + i]), as_bytes(v_buffers[layer_begin + i])
        rows_k, rows_v = packed[i, 0], packed[i, 1]  # each [num_tokens, kv_heads, head_dim]
        src_k, src_v, dst_k, dst_v = (pool_k, pool_v, rows_k, rows_v) if gather else (rows_k, rows_v, pool_k, pool_v)
        _copy_kv_rows_kernel[grid](
            src_k, src_v, dst_k, dst_v, slots,
            src_k.stride(0), src_k.stride(1), src_v.stride(0), src_v.stride(1),
            dst_k.stride(0), dst_k.stride(1), dst_v.stride(0), dst_v.stride(1),
            num_kv_heads, head_dim,
            GATHER=gather, BLOCK_H=block_h, BLOCK_D=block_d,
        )


def gather_kv(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], slots: torch.Tensor,
              out: torch.Tensor, layer_begin: int = 0) -> None:
    """`out[i, 0|1, t] = k|v_buffers[layer_begin + i][slots[t]]` for every layer i of `out` and token t.

    `out` `[num_layers, 2, num_tokens, kv_heads, head_dim]`, contiguous, the pool's dtype; `slots`
    `[num_tokens]` int32/int64.
    """
    check_transfer_args(k_buffers, v_buffers, slots, out, "out", layer_begin)
    _launch(k_buffers, v_buffers, slots, out, layer_begin, gather=True)


def scatter_kv(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], slots: torch.Tensor,
               src: torch.Tensor, layer_begin: int = 0) -> None:
    """`k|v_buffers[layer_begin + i][slots[t]] = src[i, 0|1, t]`: the inverse of `gather_kv`.

    Slots must be distinct (each is written once); `src` is laid out as `gather_kv`'s `out`.
    """
    check_transfer_args(k_buffers, v_buffers, slots, src, "src", layer_begin)
    _launch(k_buffers, v_buffers, slots, src, layer_begin, gather=False)
