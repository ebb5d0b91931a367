"""Reading the next kernel's weights into L2 while a kernel that leaves HBM idle runs.

At batch 1 a decode step alternates weight streams (GEMVs, HBM-bound) with kernels that read little: decode
attention over a short context reads ~2 MB a layer while the o_proj GEMV right after it reads 17-34 MB. Those
weights do not depend on the token, so the attention kernel's programs can ask for them ahead: every thread issues
one `cp.async.bulk.prefetch.L2.global` (Hopper and later) over its slice. The copy engine fetches the bytes into L2
while the programs go on; nothing waits for it and nothing is written, so a prefetch can only change timing. The GEMV
then finds its tiles in L2.

`bulk_prefetch_l2` runs on sm_90+ only; `PrefetchPlan` decides, on the host, the slice each thread asks for.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

ALIGN = 16
"""cp.async.bulk's address and size granularity (bytes)."""


@triton.jit
def bulk_prefetch_l2(base_ptr, total_bytes, chunk_bytes, pid, THREADS: tl.constexpr):
    """Thread t of program `pid` asks L2 for bytes [c, c + chunk) of `base_ptr`, c = (pid * THREADS + t) * chunk,
    clipped to `total_bytes` (threads past the end ask for nothing)."""
    offs = (pid * THREADS + tl.arange(0, THREADS)).to(tl.int64) * chunk_bytes
    sizes = tl.minimum(tl.maximum(total_bytes - offs, 0), chunk_bytes).to(tl.int32)
    ptrs = base_ptr.to(tl.pointer_type(tl.uint8)) + offs
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, sizes], dtype=tl.int32, is_pure=False, pack=1)


class PrefetchPlan(NamedTuple):
    """What a launch's programs prefetch: `tensor`'s first `total_bytes`, `chunk_bytes` per thread."""

    tensor: torch.Tensor
    total_bytes: int
    chunk_bytes: int


@functools.lru_cache(maxsize=16)
def _bulk_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def can_prefetch(device: torch.device) -> bool:
    """Whether kernels on `device` can issue bulk L2 prefetches (CUDA, compute capability 9.0+)."""
    if device.type != "cuda":
        return False
    return _bulk_capable(device.index if device.index is not None else torch.cuda.current_device())


def plan_prefetch(tensor: torch.Tensor | None, programs: int, threads: int) -> PrefetchPlan | None:
    """Spread `tensor`'s bytes over `programs` x `threads` slices of a multiple of 16 bytes; None when there is
    nothing to prefetch or the device cannot (the kernel then compiles without it)."""
    if tensor is None or tensor.numel() == 0 or not can_prefetch(tensor.device):
        return None
    assert tensor.is_contiguous(), "a prefetched tensor must be contiguous"
    assert tensor.data_ptr() % ALIGN == 0, f"a prefetched tensor must be {ALIGN}-byte aligned"
    total = tensor.numel() * tensor.element_size() // ALIGN * ALIGN
    slices = max(programs * threads, 1)
    chunk = -(-total // slices)
    chunk = -(-chunk // ALIGN) * ALIGN
    return PrefetchPlan(tensor, total, chunk)
