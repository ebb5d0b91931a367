"""KV gather/scatter and the pool-to-pool pull with PyTorch indexing: the CPU path of KV transfer and the
reference of the Triton kernels in `kv_transfer` (same arguments, same checks). Importing it compiles no kernel.

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


def check_pull_buffers(src_k: Sequence[torch.Tensor], src_v: Sequence[torch.Tensor], dst_k: Sequence[torch.Tensor],
                       dst_v: Sequence[torch.Tensor]) -> None:
    """Two pools' per-layer buffers for a pull (`pull_kv_rows`): the same layers, row shape and dtype; contiguous."""
    num_layers = len(dst_k)
    assert num_layers > 0 and len(src_k) == len(src_v) == len(dst_v) == num_layers, (
        f"need as many K as V buffers in both pools, at least one: got source {len(src_k)} K, {len(src_v)} V, "
        f"destination {len(dst_k)} K, {len(dst_v)} V")
    row = tuple(dst_k[0].shape[1:])
    for side, k_bufs, v_bufs in (("src", src_k, src_v), ("dst", dst_k, dst_v)):
        first = k_bufs[0]
        assert first.dim() == 3, f"{side}_k[0] must be [num_slots, kv_heads, head_dim], got {tuple(first.shape)}"
        assert tuple(first.shape[1:]) == row, (
            f"{side}_k[0] rows are {tuple(first.shape[1:])}, dst_k[0] rows {row}: the pools must share "
            "kv_heads and head_dim")
        for name, bufs in ((f"{side}_k", k_bufs), (f"{side}_v", v_bufs)):
            for i, buf in enumerate(bufs):
                check_shape(f"{name}[{i}]", buf, tuple(first.shape))
                assert buf.dtype == dst_k[0].dtype, (
                    f"{name}[{i}] has dtype {buf.dtype}, expected {dst_k[0].dtype} (KV moves bit for bit)")
                assert buf.is_contiguous(), f"{name}[{i}] must be contiguous, got strides {buf.stride()}"
    check_kv("dst_k[0]", dst_k[0])


def check_pull_slots(src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    check_index("src_slots", src_slots)
    check_index("dst_slots", dst_slots)
    assert src_slots.dtype == torch.int64, f"src_slots has dtype {src_slots.dtype}, expected int64 (a slot ring)"
    assert src_slots.shape == dst_slots.shape, (
        f"src_slots has {src_slots.shape[0]} slots, dst_slots {dst_slots.shape[0]}: one per token on both sides")


def pull_kv_rows_torch(src_k: Sequence[torch.Tensor], src_v: Sequence[torch.Tensor], dst_k: Sequence[torch.Tensor],
                       dst_v: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """`pull_kv_rows` with PyTorch indexing: `dst_k|v[l][dst_slots[t]] = src_k|v[l][src_slots[t]]` for every
    layer l and token t (all on one device)."""
    check_pull_buffers(src_k, src_v, dst_k, dst_v)
    check_pull_slots(src_slots, dst_slots)
    src_index, dst_index = src_slots.to(src_k[0].device), dst_slots.long()
    for src, dst in zip((*src_k, *src_v), (*dst_k, *dst_v)):
        as_bytes(dst).index_copy_(0, dst_index, as_bytes(src).index_select(0, src_index).to(dst.device))
