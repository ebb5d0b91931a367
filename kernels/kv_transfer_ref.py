"""KV gather/scatter with PyTorch indexing: the CPU path of KV transfer and the reference of the Triton
kernels in `kv_transfer` (same arguments, same checks). Importing it compiles no kernel.

KV moves bit for bit: FP8 pools are copied as bytes (`as_bytes`), so their values and the scales
they were written with arrive unchanged (both pools must share dtype and scales)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixmesh.kernels._checks import FP8_DTYPES, check_index, check_kv, check_shape


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor viewed as uint8 (same shape and strides: a copy moves its bits); others as they are."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def check_transfer_args(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], slots: torch.Tensor,
                         packed: torch.Tensor, packed_name: str, layer_begin: int) -> None:
    """Shapes, strides, dtypes and devices shared by gather and scatter."""
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
    check_kv("k_buffers[0]", first)
    check_index("slots", slots)
    assert slots.device == first.device, f"slots is on {slots.device}, expected {first.device}"
    assert packed.dim() == 5, (f"{packed_name} must be [num_layers, 2, num_tokens, kv_heads, head_dim], "
                               f"got {tuple(packed.shape)}")
    num_layers = packed.shape[0]
    assert layer_begin >= 0 and layer_begin + num_layers <= len(k_buffers), (
        f"layers [{layer_begin}, {layer_begin + num_layers}) of {packed_name} are outside the pool's "
        f"{len(k_buffers)} layers")
    check_shape(packed_name, packed, (num_layers, 2, slots.shape[0], first.shape[1], first.shape[2]))
    assert packed.dtype == first.dtype, (
        f"{packed_name} has dtype {packed.dtype}, expected the pool's {first.dtype} (KV moves bit for bit)")
    assert packed.device == first.device, f"{packed_name} is on {packed.device}, expected {first.device}"
    assert packed.is_contiguous(), f"{packed_name} must be contiguous, got strides {packed.stride()}"


def gather_kv_torch(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], slots: torch.Tensor,
                    out: torch.Tensor, layer_begin: int = 0) -> None:
    """`gather_kv` with PyTorch indexing (any device; the CPU path)."""
    check_transfer_args(k_buffers, v_buffers, slots, out, "out", layer_begin)
    index = slots.long()
    out = as_bytes(out)
    for i in range(out.shape[0]):
        torch.index_select(as_bytes(k_buffers[layer_begin + i]), 0, index, out=out[i, 0])
        torch.index_select(as_bytes(v_buffers[layer_begin + i]), 0, index, out=out[i, 1])


def scatter_kv_torch(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], slots: torch.Tensor,
                     src: torch.Tensor, layer_begin: int = 0) -> None:
    """`scatter_kv` with PyTorch indexing (any device; the CPU path)."""
    check_transfer_args(k_buffers, v_buffers, slots, src, "src", layer_begin)
    index = slots.long()
    src = as_bytes(src)
    for i in range(src.shape[0]):
        as_bytes(k_buffers[layer_begin + i]).index_copy_(0, index, src[i, 0])
        as_bytes(v_buffers[layer_begin + i]).index_copy_(0, index, src[i, 1])
