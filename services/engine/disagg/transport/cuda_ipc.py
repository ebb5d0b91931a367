"""`cuda-ipc`: KV moves GPU to GPU between two processes of one host, without a host round trip.

Export gathers the slots' KV into a staging buffer on the prefill GPU and sends only a CUDA IPC
handle of it (plus torch's IPC reference counter and event, so the copy waits for the gather).
The decode side opens the handle, copies the buffer device to device onto its own GPU (NVLink
or PCIe peer to peer) and scatters it into its slots. The staging buffer lives until `release`.

Both processes must see both GPUs (the decode process opens memory of the prefill GPU): run
them with the same devices visible, e.g. CUDA_VISIBLE_DEVICES=0,1 for prefill and 1,0 for
decode, each then using its own first device. GPUs are matched by UUID, not by index.
"""

from __future__ import annotations

import msgspec
import torch

from radixmesh.common.errors import invalid_argument, unsupported
from radixmesh.engine.disagg import kv_io
from radixmesh.engine.disagg.messages import KVChunk
from radixmesh.engine.disagg.transport.base import DEFAULT_CHUNK_BYTES, BaseKVTransport, dtype_name
from radixmesh.engine.memory import TokenToKVPool


class IpcHandle(msgspec.Struct, frozen=True):
    """What the decode side needs to open the staging buffer (torch's `_share_cuda_` fields)."""

    device_uuid: str
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    shape: list[int]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(IpcHandle)


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class CudaIpcKVTransport(BaseKVTransport):
    transport_id = "cuda-ipc"
    device_types = ("cuda",)

    def __init__(self, pool: TokenToKVPool, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if pool.device.type != "cuda":
            raise unsupported("the cuda-ipc KV transport needs the KV pool on a CUDA device", "kv_transport")
        super().__init__(pool, max_chunk_bytes)
        self._staging: dict[str, torch.Tensor] = {}
        self._opened: list[torch.Tensor] = []

    def export(self, transfer_id: str, slots: torch.Tensor) -> list[KVChunk]:
        pool, num_tokens = self.pool, slots.shape[0]
        shape = kv_io.packed_shape(pool, pool.num_layers, num_tokens)
        staging = torch.empty(shape, dtype=pool.dtype, device=pool.device)
        kv_io.gather(pool, slots, staging)
        self._staging[transfer_id] = staging
        # records an event after the gather, which the decode side's copy waits for
        dev, ipc, size, offset, ref_handle, ref_offset, event, sync = staging.untyped_storage()._share_cuda_()
        index = pool.device.index if pool.device.index is not None else torch.cuda.current_device()
        handle = IpcHandle(device_uuid(index), dev, ipc, size, offset, ref_handle, ref_offset, event, sync,
                           list(shape))
        num_bytes = staging.numel() * staging.element_size()
        return [KVChunk(self.transport_id, 0, pool.num_layers, num_tokens, dtype_name(pool.dtype),
                        _encoder.encode(handle), num_bytes)]

    def release(self, transfer_id: str) -> None:
        self._staging.pop(transfer_id, None)  # torch keeps the block until the decode side let go

    def receive(self, chunk: KVChunk, slots: torch.Tensor) -> None:
        self.check_chunk(chunk, slots.shape[0])
        handle = _decoder.decode(chunk.data)
        shape = kv_io.packed_shape(self.pool, chunk.layer_end - chunk.layer_begin, chunk.num_tokens)
        if tuple(handle.shape) != shape:
            raise invalid_argument(f"the shared KV buffer is {tuple(handle.shape)}, expected {shape}")
        remote = self._open(handle)
        local = remote.to(self.pool.device, non_blocking=True)  # device to device (peer copy)
        self._opened.append(remote)
        kv_io.scatter(self.pool, slots, local, chunk.layer_begin)

    def finish(self) -> None:
        torch.cuda.synchronize(self.pool.device)
        self._opened.clear()  # drops our references: the prefill side may free its staging buffers

    def _open(self, handle: IpcHandle) -> torch.Tensor:
        local_index = _local_index(handle.device_uuid)
        with torch.cuda.device(local_index):
            storage = torch.UntypedStorage._new_shared_cuda(
                local_index, handle.handle, handle.storage_size_bytes, handle.storage_offset_bytes,
                handle.ref_counter_handle, handle.ref_counter_offset, handle.event_handle,
                handle.event_sync_required)
            tensor = torch.empty(0, dtype=self.pool.dtype, device=f"cuda:{local_index}")
            tensor.set_(storage, 0, handle.shape, _contiguous_strides(handle.shape))
        return tensor


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def _local_index(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise unsupported(f"the prefill worker's GPU {uuid} is not visible to this process: cuda-ipc needs both "
                      "workers on one host with each other's GPUs visible (see docs/disaggregation.md)",
                      "kv_transport")
