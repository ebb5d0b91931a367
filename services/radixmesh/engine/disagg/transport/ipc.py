"""The CUDA IPC calls of the cuda-ipc transport, behind one small class (CPU tests substitute a fake).

Memory is shared through torch's `_share_cuda_` / `_new_shared_cuda` (a cudaIpcMemHandle of the
caching allocator's block plus the offset in it), events through `torch.cuda.Event(interprocess=True)`.
GPUs are named by UUID: the two processes may number them differently.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import msgspec
import torch

from radixmesh.common.errors import unsupported

_NO_EVENT = bytes(64)
"""An event handle field torch does not read (event_sync_required false)."""


class SharedBuffer(msgspec.Struct, array_like=True, frozen=True):
    """A device buffer shared once: what another process needs to map it (torch's `_share_cuda_` fields)."""

    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """`device` current for the block (CUDA; a CPU device changes nothing)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


class CudaIpc:
    def device_uuid(self, device: torch.device) -> str:
        index = device.index if device.index is not None else torch.cuda.current_device()
        return str(torch.cuda.get_device_properties(index).uuid)

    def local_device(self, uuid: str) -> torch.device:
        """This process's device of the GPU `uuid`; UNSUPPORTED when it does not see that GPU."""
        for index in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(index).uuid) == uuid:
                return torch.device("cuda", index)
        raise unsupported(f"the prefill worker's GPU {uuid} is not visible to this process: cuda-ipc needs both "
                          "workers on one host with each other's GPUs visible (see docs/disaggregation.md)",
                          "kv_transport")

    def can_access_peer(self, device: torch.device, peer: torch.device) -> bool:
        """Kernels on `device` can read memory of `peer` (the same GPU, or P2P over NVLink or PCIe)."""
        return device == peer or torch.cuda.can_device_access_peer(device, peer)

    def share(self, tensor: torch.Tensor) -> SharedBuffer:
        """Share a whole-storage tensor. Call it once per tensor: each call wraps the storage in another
        torch IPC reference counter and records another event."""
        assert tensor.storage_offset() == 0 and tensor.is_contiguous(), "share whole, contiguous tensors only"
        _, handle, size, offset, ref_handle, ref_offset, _, _ = tensor.untyped_storage()._share_cuda_()
        return SharedBuffer(handle, size, offset, ref_handle, ref_offset)

    def open(self, buf: SharedBuffer, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """Map another process's buffer for kernels on `device` (this process's view of its GPU or a peer).

        Mapped under the device whose kernels read it, as the custom all-reduce does: the tensor says
        `device` though the memory may live on a peer GPU. No event is waited on (callers order the reads)."""
        with on_device(device):
            storage = torch.UntypedStorage._new_shared_cuda(
                device.index, buf.handle, buf.size_bytes, buf.offset_bytes, buf.ref_counter_handle,
                buf.ref_counter_offset, _NO_EVENT, False)
            tensor = torch.empty(0, dtype=dtype, device=device)
            assert storage.nbytes() >= math.prod(shape) * tensor.element_size(), (
                f"the shared buffer has {storage.nbytes()} bytes, {tuple(shape)} {dtype} needs more")
            tensor.set_(storage, 0, shape, contiguous_strides(shape))
        return tensor

    def record_event(self, device: torch.device) -> tuple[object, bytes]:
        """An interprocess event recorded on `device`'s current stream, and its IPC handle. Keep the event
        until the other process has waited on it."""
        event = torch.cuda.Event(interprocess=True)
        event.record(torch.cuda.current_stream(device))
        return event, event.ipc_handle()

    def wait_event(self, handle: bytes, device: torch.device) -> object:
        """Make `device`'s current stream wait for another process's event; returns the opened event, to keep
        until that stream's work is done."""
        event = torch.cuda.Event.from_ipc_handle(device, handle)
        event.wait(torch.cuda.current_stream(device))
        return event


def contiguous_strides(shape: tuple[int, ...] | list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]
