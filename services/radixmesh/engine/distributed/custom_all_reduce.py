"""`--enable-custom-all-reduce`: small all-reduces of a tensor-parallel group by the one-shot kernel
(`radixmesh.kernels.allreduce`) over buffers the ranks map from each other with CUDA IPC.

Messages up to `max_bytes` (a decode step's `[batch, hidden]` rows) take it; larger ones, other
dtypes and non-contiguous tensors fall back to NCCL. Every rank makes the same calls with the same
shapes (rank 0 drives the steps), so every rank takes the same path. Needs peer access between
the GPUs, without which the group stays on NCCL, and atomics on peer memory (the flags): NVLink
(PCIe P2P often lacks peer atomics; do not turn it on there).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from radixmesh.kernels.allreduce import buffer_bytes, one_shot_all_reduce

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 1 << 18
"""Largest message the engine sends through the one-shot path (32 rows of 4096 bf16); each buffer is `2 * world`
times this. On two H200s in CUDA graphs it beat NCCL up to 16 rows (8.0 vs 14.1 us) and lost at 64 (19.4 vs 17.1)."""
BENCH_MAX_BYTES = 1 << 20
"""The benchmark's limit: it times the one-shot path past the engine's, to find where NCCL wins."""
MAX_PROGRAMS = 64
"""Most programs of one call (the flag arrays have a slot per rank and program)."""


class CustomAllReduce:
    """One-shot all-reduce of one rank over `buffers[p]` / `flags[p]`: rank p's shared buffer and flag
    array as this process addresses them (its own at `rank`)."""

    def __init__(self, rank: int, world: int, buffers: list[torch.Tensor], flags: list[torch.Tensor],
                 device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        assert len(buffers) == len(flags) == world, f"{len(buffers)} buffers, {len(flags)} flag arrays, {world} ranks"
        need = buffer_bytes(max_bytes, world)
        assert all(b.numel() * b.element_size() >= need for b in buffers), f"buffers smaller than {need} bytes"
        assert all(f.dtype == torch.int32 and f.numel() >= world * MAX_PROGRAMS for f in flags), "flag arrays too small"
        self.rank, self.world, self.device, self.max_bytes = rank, world, device, max_bytes
        addresses = [b.data_ptr() for b in buffers] + [f.data_ptr() for f in flags]
        self.table = torch.tensor(addresses, dtype=torch.int64, device=device)
        self.counters = torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=device)
        self._mapped = [*buffers, *flags]  # keeps the peers' mappings open

    def can_run(self, x: torch.Tensor) -> bool:
        return (x.device == self.device and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
                and x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place; returns `x`."""
        return one_shot_all_reduce(x, x, self.table, self.counters, self.rank, self.world,
                                   buffer_bytes(self.max_bytes, self.world))

    @classmethod
    def over_cuda_ipc(cls, rank: int, world: int, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES,
                      all_gather: Callable[[Any], list[Any]] | None = None) -> CustomAllReduce | None:
        """Allocate this rank's buffer and flags, exchange CUDA IPC handles with the group and map the
        peers'; None (the group stays on NCCL) when a peer's GPU is not accessible from this one.

        `all_gather(obj)` returns every rank's `obj` in rank order (a collective every rank calls; by
        default torch.distributed's `all_gather_object`)."""
        gather = all_gather or _all_gather_object
        index = device.index if device.index is not None else torch.cuda.current_device()
        devices = gather(index)
        peers_ok = all(torch.cuda.can_device_access_peer(index, other) for other in set(devices) if other != index)
        if not all(gather(peers_ok)):
            logger.warning("custom all-reduce off: the GPUs of this group cannot access each other (no P2P)")
            return None
        buffer = torch.empty(buffer_bytes(max_bytes, world), dtype=torch.uint8, device=device)
        flags = torch.zeros(world * MAX_PROGRAMS, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)  # the flags are zero before any peer can see them
        handles = gather((buffer.untyped_storage()._share_cuda_(), flags.untyped_storage()._share_cuda_()))
        buffers, flag_arrays = [], []
        for peer, (buffer_handle, flags_handle) in enumerate(handles):
            if peer == rank:
                buffers.append(buffer)
                flag_arrays.append(flags)
                continue
            buffers.append(_open(buffer_handle, torch.uint8, index))
            flag_arrays.append(_open(flags_handle, torch.int32, index))
        gather(True)  # a barrier: every rank mapped every buffer before anyone raises a flag
        logger.info("custom all-reduce on for messages up to %d bytes", max_bytes)
        return cls(rank, world, buffers, flag_arrays, device, max_bytes)


def _all_gather_object(obj: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _open(handle: tuple[Any, ...], dtype: torch.dtype, device: int) -> torch.Tensor:
    """A peer's shared storage (torch's `_share_cuda_` fields) mapped for this rank's `device`, as a flat tensor.

    Opened under this rank's device, not the peer's: the mapping then gives this device access (peer
    access for a cudaMalloc block, an access grant for a segment of torch's expandable allocator). Opened
    under the peer's device, copies still work but this device's kernels fault on the addresses (an
    illegal memory access on two H200s). The tensor says `device` though the memory lives on the peer's
    GPU: only its address is used."""
    with torch.cuda.device(device):
        storage = torch.UntypedStorage._new_shared_cuda(device, *handle[1:])
        tensor = torch.empty(0, dtype=dtype, device=f"cuda:{device}")
        tensor.set_(storage, 0, (storage.nbytes() // tensor.element_size(),), (1,))
    return tensor
