"""Token-major KV copies with PyTorch indexing: the CPU path of the hierarchical cache's host tier and the
reference of the Triton kernels in `kv_host` (same arguments, same checks). Importing it compiles no kernel.

The host tier keeps each token's KV of every layer together, `[num_tokens, num_layers, 2, kv_heads,
head_dim]` (index 0 of the third axis is K, 1 is V), so the KV of a run of consecutive host slots is one
contiguous block: one DMA moves it between pinned host memory and a device staging buffer of the same
layout. The device pool is per layer `[num_slots, kv_heads, head_dim]` (page size one token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixmesh.kernels._checks import check_float, check_index, check_shape


def check_token_major_args(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor],
                           slots: torch.Tensor, packed: torch.Tensor, packed_name: str) -> None:
    """Shapes, strides, dtypes and devices shared by the token-major gather and scatter."""
    assert len(k_buffers) == len(v_buffers) and k_buffers, (
        f"need as many K as V buffers, at least one: got {len(k_buffers)} K and {len(v_buffers)} V")
    first = k_buffers[0]
    assert first.dim() == 3, f"k_buffers[0] must be [num_slots, kv_heads, head_dim], got {tuple(first.shape)}"
    for name, bufs in (("k_buffers", k_buffers), ("v_buffers", v_buffers)):
        for i, buf in enumerate(bufs):
            check_shape(f"{name}[{i}]", buf, tuple(first.shape))
            assert buf.dtype == first.dtype, f"{name}[{i}] has dtype {buf.dtype}, expected {first.dtype}"
            assert buf.device == first.device, f"{name}[{i}] is on {buf.device}, expected {first.device}"
            assert buf.stride(-1) == 1, f"{name}[{i}] must have a contiguous last dim, got strides {buf.stride()}"
    check_float("k_buffers[0]", first)
    check_index("slots", slots)
    assert slots.device == first.device, f"slots is on {slots.device}, expected {first.device}"
    expected = (slots.shape[0], len(k_buffers), 2, first.shape[1], first.shape[2])
    check_shape(packed_name, packed, expected)
    assert packed.dtype == first.dtype, (
        f"{packed_name} has dtype {packed.dtype}, expected the pool's {first.dtype} (KV moves bit for bit)")
    assert packed.device == first.device, f"{packed_name} is on {packed.device}, expected {first.device}"
    assert packed.is_contiguous(), f"{packed_name} must be contiguous, got strides {packed.stride()}"


def gather_kv_tokens_torch(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor],
                           slots: torch.Tensor, out: torch.Tensor) -> None:
    """`out[t, l, 0|1] = k|v_buffers[l][slots[t]]` for every token t and layer l."""
    check_token_major_args(k_buffers, v_buffers, slots, out, "out")
    index = slots.long()
    for layer, (k, v) in enumerate(zip(k_buffers, v_buffers)):
        out[:, layer, 0].copy_(k.index_select(0, index))
        out[:, layer, 1].copy_(v.index_select(0, index))


def scatter_kv_tokens_torch(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor],
                            slots: torch.Tensor, src: torch.Tensor) -> None:
    """`k|v_buffers[l][slots[t]] = src[t, l, 0|1]`: the inverse of `gather_kv_tokens_torch` (distinct slots)."""
    check_token_major_args(k_buffers, v_buffers, slots, src, "src")
    index = slots.long()
    for layer, (k, v) in enumerate(zip(k_buffers, v_buffers)):
        k.index_copy_(0, index, src[:, layer, 0])
        v.index_copy_(0, index, src[:, layer, 1])
