"""One-shot all-reduce of small messages over buffers every rank can address (CUDA IPC peer mappings).

NCCL's all-reduce of one 4096-wide bf16 row takes ~17 us inside a CUDA graph, a few times what
moving 8 KB over NVLink needs. Here each rank writes its input into its own slot of every rank's
shared buffer (NVLink writes are posted: no round trip), raises a flag in every peer's flag array,
waits for every peer's flag, then sums the slots of its own buffer: one launch, one round of flags,
no reads over the link.

- Every program (block) owns one contiguous slice of the message and synchronises with the
  same program of the other ranks only (the ranks launch the same grid), so no grid-wide
  barrier is needed.
- Flags carry an epoch that every program counts itself in device memory (`counters`), so the
  kernel replays inside CUDA graphs with fixed arguments. Epoch parity picks one of two halves
  of the buffers: a rank can reach call k+1 only after every peer entered call k+1, i.e. after
  they finished reading call k, so the half of call k+2 is free again.
- Every rank sums all ranks' copies in rank order, so the results are bitwise the same on every
  rank (the residual stream stays replicated exactly).

`table` holds the int64 addresses (in this process) of every rank's buffer, then of every
rank's flag array `[world, max_programs]` int32 (rank r raises `flags_p[r, program]`). A buffer is two
halves of `world` slots (rank r writes slot r): `buffer_bytes(max_bytes, world)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import check_device, check_float
from radixmesh.kernels._pdl import gdc_launch_dependents, gdc_wait, pdl_args

BLOCK = 1024
"""Elements a program moves per iteration."""


@triton.jit
def _one_shot_all_reduce_kernel(inp_ptr, out_ptr, table_ptr, counters_ptr, n, per_program, rank,
                                WORLD: tl.constexpr, MAX_PROGRAMS: tl.constexpr, HALF: tl.constexpr,
                                SLOT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    if PDL:  # the input comes from the kernel before; the next one may start loading its weights
        gdc_wait()
        gdc_launch_dependents()
    dtype = inp_ptr.dtype.element_ty
    epoch = tl.load(counters_ptr + pid) + 1
    half = (epoch % 2).to(tl.int64) * HALF
    begin = pid * per_program
    end = tl.minimum(begin + per_program, n)
    own = tl.load(table_ptr + rank).to(tl.pointer_type(dtype))
    for off in range(begin, end, BLOCK):  # 1. this rank's slice into its slot of every rank's buffer
        offs = off + tl.arange(0, BLOCK)
        mask = offs < end
        vals = tl.load(inp_ptr + offs, mask=mask)
        for p in tl.static_range(WORLD):
            buf = tl.load(table_ptr + p).to(tl.pointer_type(dtype))
            tl.store(buf + half + rank * SLOT + offs, vals, mask=mask)
    tl.debug_barrier()
    for p in tl.static_range(WORLD):  # 2. tell every peer, then wait for every peer
        if p != rank:
            flags_p = tl.load(table_ptr + WORLD + p).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(flags_p + rank * MAX_PROGRAMS + pid, epoch, sem="release", scope="sys")
    own_flags = tl.load(table_ptr + WORLD + rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        if p != rank:
            seen = tl.atomic_add(own_flags + p * MAX_PROGRAMS + pid, 0, sem="acquire", scope="sys")
            while seen < epoch:
                seen = tl.atomic_add(own_flags + p * MAX_PROGRAMS + pid, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    for off in range(begin, end, BLOCK):  # 3. every rank's slot of this rank's buffer, summed in rank order
        offs = off + tl.arange(0, BLOCK)
        mask = offs < end
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for p in tl.static_range(WORLD):
            acc += tl.load(own + half + p * SLOT + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(dtype), mask=mask)
    tl.store(counters_ptr + pid, epoch)


def buffer_bytes(max_bytes: int, world: int) -> int:
    """Size of each rank's shared buffer for messages of up to `max_bytes`: two halves of `world` slots."""
    return 2 * world * max_bytes


def num_programs(n: int, max_programs: int) -> int:
    """Programs of a call over `n` elements (the same on every rank)."""
    return max(1, min(max_programs, triton.cdiv(n, BLOCK)))


def one_shot_all_reduce(inp: torch.Tensor, out: torch.Tensor, table: torch.Tensor, counters: torch.Tensor,
                        rank: int, world: int, buffer_bytes: int) -> torch.Tensor:
    """`out = sum over ranks of inp` (every rank calls it with the same shape); `out` may be `inp`.

    `buffer_bytes` is the size of each rank's shared buffer (`buffer_bytes(max_bytes, world)`: two halves of `world`
    slots); `counters` `[max_programs]`
    int32 is this rank's epochs, zero at first; `table` `[2 * world]` int64 (see the module doc).
    """
    device = inp.device
    for name, t in (("inp", inp), ("out", out), ("table", table), ("counters", counters)):
        check_device(name, t, device)
    check_float("inp", inp)
    assert inp.is_contiguous() and out.is_contiguous(), "inp and out must be contiguous"
    assert out.shape == inp.shape and out.dtype == inp.dtype, (
        f"out is {out.dtype} {tuple(out.shape)}, inp is {inp.dtype} {tuple(inp.shape)}")
    assert table.dtype == torch.int64 and tuple(table.shape) == (2 * world,), (
        f"table must be int64 [{2 * world}], got {table.dtype} {tuple(table.shape)}")
    assert counters.dtype == torch.int32 and counters.dim() == 1, f"counters must be int32 [programs], got {counters}"
    assert 0 <= rank < world, f"rank {rank} outside a group of {world}"
    slot = buffer_bytes // 2 // world // inp.element_size()
    n = inp.numel()
    assert n <= slot, (f"{n * inp.element_size()} bytes do not fit a rank's slot ({slot * inp.element_size()} bytes) "
                       f"of the {buffer_bytes}-byte buffer")
    if n == 0:
        return out
    max_programs = counters.shape[0]
    grid = num_programs(n, max_programs)
    per_program = triton.cdiv(triton.cdiv(n, grid), BLOCK) * BLOCK
    _one_shot_all_reduce_kernel[(grid,)](
        inp, out, table, counters, n, per_program, rank,
        WORLD=world, MAX_PROGRAMS=max_programs, HALF=slot * world, SLOT=slot, BLOCK=BLOCK, **pdl_args(device))
    return out
