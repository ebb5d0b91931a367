"""Host<->device copies on the engine's hot path that never make the host wait for the device.

The overlap scheduler builds batch N+1 on the host while the device runs batch N. A blocking
copy defeats it: `torch.tensor(values, device="cuda")` and `cpu_tensor.to("cuda")` issue
cudaMemcpyAsync then cudaStreamSynchronize, i.e. wait for every kernel already queued (the
forward pass just launched), and `.tolist()`, `.item()` or `float(t[i])` of a device tensor
do the same. Every hot-path copy goes through this module instead:

- host -> device (`to_device`, `rows_to_device`, `tensor_to_device`, `copy_to_device`): the values
  go into page-locked (pinned) memory and are copied with `non_blocking=True`. The pinned block
  comes from PyTorch's caching host allocator, which records the copy on the stream and does not
  hand the block out again before the copy ran, so the source tensor may be dropped at once.
- device -> host (`HostCopy`): results are copied into pinned memory with `non_blocking=True`
  and a CUDA event is recorded on the stream right after; `wait()` blocks on that event only,
  not on work queued behind it.

On a CPU device nothing is copied, nothing is pinned and nothing waits.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float] | Sequence[bool], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A 1-D tensor of host `values` on `device`, copied without waiting for queued device work."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def rows_to_device(rows: Sequence[Sequence[int]], device: torch.device,
                   dtype: torch.dtype = torch.int64) -> list[torch.Tensor]:
    """Several host lists in one copy: one view of a packed device tensor per row, in order."""
    packed = to_device(list(itertools.chain.from_iterable(rows)), dtype, device)
    return list(torch.split_with_sizes(packed, [len(row) for row in rows]))


def tensor_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`; pinned first (unless it is) so that the copy cannot block."""
    assert host.device.type == "cpu", f"tensor_to_device takes a CPU tensor, got one on {host.device}"
    if device.type != "cuda":
        return host.to(device)
    if not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def copy_to_device(dst: torch.Tensor, values: Sequence[int] | Sequence[float]) -> None:
    """Write host `values` (as many as `dst` has elements) into `dst` without blocking."""
    assert len(values) == dst.numel(), f"{len(values)} values for a tensor of {dst.numel()} elements"
    host = torch.tensor(values, dtype=dst.dtype, pin_memory=dst.is_cuda)
    dst.copy_(host.view(dst.shape), non_blocking=dst.is_cuda)


class HostCopy:
    """Host copies of device tensors, started at construction and awaited by `wait()`.

    Build it right after the kernels that produce the tensors were queued; the event recorded
    then lets `wait()` return as soon as these copies landed, while later work keeps running.
    CPU tensors are passed through as they are.
    """

    def __init__(self, tensors: Sequence[torch.Tensor | None]) -> None:
        self._event: torch.cuda.Event | None = None
        cuda = [t for t in tensors if t is not None and t.is_cuda]
        if not cuda:
            self._host: list[torch.Tensor | None] = list(tensors)
            return
        self._host = [_pinned_copy(t) if t is not None and t.is_cuda else t for t in tensors]
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(cuda[0].device))

    def ready(self) -> bool:
        """Whether `wait()` would return at once."""
        return self._event is None or self._event.query()

    def wait(self) -> list[torch.Tensor | None]:
        """The host tensors, in the order given; blocks until their copies completed."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
