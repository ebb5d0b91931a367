"""KV transfer kernels: gather the KV of given pool slots into one contiguous buffer, and scatter such
a buffer into given slots (prefill/decode disaggregation moves a prompt's KV this way); or pull the rows
straight from one pool into another (`pull_kv_rows`: no buffer in between).

The contiguous layout is `[num_layers, 2, num_tokens, kv_heads, head_dim]` (index 0 of the second
axis is K, 1 is V), so any range of layers is one contiguous block: a transport sends layer ranges
as they are. Pool buffers are per layer `[num_slots, kv_heads, head_dim]` (page size one token).
One launch per layer copies every token of that layer; there is no loop over tokens on the host.
`kv_transfer_ref` does the same with PyTorch indexing (the CPU path and the tests' reference).

The pull reads the source pool through an address table (`KVRowTable`, built once per pair of pools),
so one launch moves every layer, and the source may be another process's pool mapped with CUDA IPC
(on a peer GPU, read over NVLink or PCIe). Rows move as words of up to 8 bytes (FP8 moves as bits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import check_device, next_power_of_2
from radixmesh.kernels.kv_transfer_ref import as_bytes, check_pull_buffers, check_pull_slots, check_transfer_args

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


# words of one pull tile: 16 KiB of 8-byte words, 16 per thread of 4 warps (8 loads of 16 B in flight)
_PULL_TILE_WORDS = 2048
_PULL_MAX_ROW_BLOCK = 1024
_WORD_TYPES = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


@triton.jit(do_not_specialize=["src_slots_addr", "num_tokens"])  # one compile for every transfer of a pool pair
def _pull_kv_rows_kernel(
    table_ptr, src_slots_addr, dst_slots_ptr, num_tokens, num_layers, row_words,
    WORD: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
):
    # program (token block, layer, K|V): row dst_slots[t] of the destination buffer <- row src_slots[t] of the
    # source one, for the block's tokens t. table: [src K layers, src V layers, dst K layers, dst V layers]
    buf = tl.program_id(2) * num_layers + tl.program_id(1)
    src = tl.load(table_ptr + buf).to(tl.pointer_type(WORD))
    dst = tl.load(table_ptr + 2 * num_layers + buf).to(tl.pointer_type(WORD))
    if ALIGNED:  # every buffer starts on 16 bytes: rows move in 16-byte vectors when row_words allows
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
    src_slots = src_slots_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    src_rows = tl.load(src_slots + offs_t, mask=mask_t, other=0)
    dst_rows = tl.load(dst_slots_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    for w in range(0, row_words, BLOCK_W):
        offs_w = w + tl.arange(0, BLOCK_W)
        mask = mask_t[:, None] & (offs_w[None, :] < row_words)
        # [BLOCK_T, BLOCK_W] words
        rows = tl.load(src + src_rows[:, None] * row_words + offs_w[None, :], mask=mask)
        tl.store(dst + dst_rows[:, None] * row_words + offs_w[None, :], rows, mask=mask)


@dataclass(frozen=True)
class KVRowTable:
    """Every layer's K and V buffer of a source and a destination pool, as `pull_kv_rows` reads them.

    `addresses` `[4 * num_layers]` int64 on `device` (the destination's): source K, source V, destination
    K, destination V, layer by layer. The buffers are kept here: the addresses stay valid while the table lives.
    """

    src_k: tuple[torch.Tensor, ...]
    src_v: tuple[torch.Tensor, ...]
    dst_k: tuple[torch.Tensor, ...]
    dst_v: tuple[torch.Tensor, ...]
    addresses: torch.Tensor
    device: torch.device
    row_bytes: int
    """Bytes of one slot's K (or V) row: kv_heads * head_dim * itemsize."""
    word_bytes: int
    """Bytes moved per element: the largest of 8, 4, 2, 1 dividing row_bytes and every buffer's address."""
    aligned: bool
    """Every buffer starts on 16 bytes (the kernel may use 16-byte vectors)."""

    @property
    def num_layers(self) -> int:
        return len(self.dst_k)


def make_kv_row_table(src_k: Sequence[torch.Tensor], src_v: Sequence[torch.Tensor], dst_k: Sequence[torch.Tensor],
                      dst_v: Sequence[torch.Tensor]) -> KVRowTable:
    """The table of a pull from the pool (src_k, src_v) into the pool (dst_k, dst_v) (one host-to-device copy).

    The source buffers are addressed from the destination's device: tensors on it (e.g. another process's
    pool mapped there with CUDA IPC) or on a GPU it has peer access to (enabled in this process).
    """
    check_pull_buffers(src_k, src_v, dst_k, dst_v)
    device = dst_k[0].device
    for name, bufs in (("dst_k", dst_k), ("dst_v", dst_v)):
        for i, buf in enumerate(bufs):
            check_device(f"{name}[{i}]", buf, device)
    for name, bufs in (("src_k", src_k), ("src_v", src_v)):
        for i, buf in enumerate(bufs):
            _check_readable(f"{name}[{i}]", buf, device)
    buffers = [*src_k, *src_v, *dst_k, *dst_v]
    addresses = [buf.data_ptr() for buf in buffers]
    row_bytes = dst_k[0].shape[1] * dst_k[0].shape[2] * dst_k[0].element_size()
    word_bytes = next(w for w in (8, 4, 2, 1) if all(n % w == 0 for n in (row_bytes, *addresses)))
    table = torch.tensor(addresses, dtype=torch.int64).to(device)
    return KVRowTable(tuple(src_k), tuple(src_v), tuple(dst_k), tuple(dst_v), table, device, row_bytes, word_bytes,
                      aligned=all(a % 16 == 0 for a in addresses))


def _check_readable(name: str, buf: torch.Tensor, device: torch.device) -> None:
    if buf.device == device:
        return
    assert buf.device.type == device.type == "cuda", f"{name} is on {buf.device}: {device} cannot read it"
    assert torch.cuda.can_device_access_peer(device, buf.device), (
        f"{name} is on {buf.device}, which {device} has no peer access to")


def pull_kv_rows(table: KVRowTable, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """`dst_k|v[l][dst_slots[t]] = src_k|v[l][src_slots[t]]` for every layer l of `table` and token t: one launch.

    `src_slots` `[num_tokens]` int64 (slots of the source pool; like the source buffers it may be mapped from
    another process), `dst_slots` `[num_tokens]` int32/int64 on the destination's device, distinct.
    """
    check_pull_slots(src_slots, dst_slots)
    check_device("dst_slots", dst_slots, table.device)
    _check_readable("src_slots", src_slots, table.device)
    num_tokens = src_slots.shape[0]
    if num_tokens == 0:
        return
    row_words = table.row_bytes // table.word_bytes
    block_w = min(next_power_of_2(row_words), _PULL_MAX_ROW_BLOCK)
    block_t = max(1, _PULL_TILE_WORDS // block_w)
    grid = (triton.cdiv(num_tokens, block_t), table.num_layers, 2)
    _pull_kv_rows_kernel[grid](
        table.addresses, src_slots.data_ptr(), dst_slots, num_tokens, table.num_layers, row_words,
        WORD=_WORD_TYPES[table.word_bytes], ALIGNED=table.aligned, BLOCK_T=block_t, BLOCK_W=block_w,
    )
