"""The tensor-parallel group over torch.distributed: NCCL on CUDA (one device per rank), gloo on CPU.

All collectives of a worker run in the default process group, so a process belongs to at most
one tensor-parallel group at a time (`destroy` ends it).
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from radixmesh.engine.distributed.custom_all_reduce import CustomAllReduce

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 600
"""A collective waiting longer than this (a rank died mid-step) fails instead of hanging forever."""
_threads_before: int | None = None


def rank_device(device_type: str, rank: int) -> torch.device:
    """The device of `rank`: `cuda:rank` (one GPU per rank) or the CPU."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


class TorchCommunicator:
    """`Communicator` over the default torch.distributed group."""

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.custom: CustomAllReduce | None = None
        """The one-shot kernel for small messages (`--enable-custom-all-reduce`), else None: NCCL/gloo only."""

    @classmethod
    def init(cls, rank: int, size: int, init_method: str, device: torch.device,
             custom_all_reduce: bool = False) -> TorchCommunicator:
        """Join the group (blocks until all `size` ranks joined) and warm its communicator up; with
        `custom_all_reduce` (CUDA) also map the one-shot all-reduce's buffers (a collective)."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=size,
                                    timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S), device_id=device)
        else:
            global _threads_before
            _threads_before = torch.get_num_threads()
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # the ranks share this host's cores
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                                    timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        comm = cls(rank, size, device)
        comm.all_reduce(torch.ones(1, device=device))  # NCCL sets its channels up here, not inside a graph capture
        if custom_all_reduce and device.type == "cuda":
            from radixmesh.engine.distributed.custom_all_reduce import CustomAllReduce

            comm.custom = CustomAllReduce.over_cuda_ipc(rank, size, device)
        logger.info("tensor-parallel rank %d of %d on %s joined", rank, size, device)
        return comm

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.custom is not None and self.custom.can_run(x):
            return self.custom.all_reduce(x)
        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dim() >= 1, "all_gather takes a tensor of at least one dimension"
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous())
        return out.view(self.size, *x.shape)

    def all_to_all(self, x: torch.Tensor, send_rows: list[int], recv_rows: list[int]) -> torch.Tensor:
        out = torch.empty((sum(recv_rows), *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x.contiguous(), recv_rows, send_rows)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        assert x.shape[0] % self.size == 0, f"reduce_scatter of {x.shape[0]} rows over {self.size} ranks"
        rows = x.shape[0] // self.size
        if self.device.type != "cuda":  # gloo has no reduce-scatter of one tensor: the sum, then this rank's block
            dist.all_reduce(x)
            return x[self.rank * rows:(self.rank + 1) * rows]
        out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x.contiguous())
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(x, src)
        return x

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (every rank gets it)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    @staticmethod
    def destroy(abort: bool = False) -> None:
        """Leave the group (and give the process back its CPU threads); every rank calls it at about the same
        time. `abort`: another rank is gone, so NCCL's orderly teardown would wait for it."""
        global _threads_before
        if dist.is_initialized():
            abort_group = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort and abort_group is not None and dist.get_backend() == "nccl":
                logger.warning("a tensor-parallel rank is gone: aborting the NCCL group")
                abort_group()
            else:
                dist.destroy_process_group()
        if _threads_before is not None:
            torch.set_num_threads(_threads_before)
            _threads_before = None
