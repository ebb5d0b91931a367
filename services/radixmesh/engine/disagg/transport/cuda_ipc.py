"""`cuda-ipc`: KV moves GPU to GPU between two processes of one host, without a host round trip.

Two modes; the receiver follows whichever the chunk's data names:

- `direct` (the default): the prefill pool and a slot ring are shared once; an export copies the
  prompt's slot indices into the ring and sends their place plus an event, and the decode GPU
  pulls the rows out of the prefill pool with one kernel (`ipc_direct`). No staging buffer, no
  gather, no per-transfer mapping.
- `staging`: export gathers the slots' KV into a staging buffer on the prefill GPU and sends a
  CUDA IPC handle of it (plus torch's IPC reference counter and event, so the copy waits for the
  gather); the decode side opens the handle, copies the buffer device to device onto its GPU and
  scatters it. The staging buffer lives until `release`. A sharded (TP) prefill pool, and a
  transfer that finds the slot ring full, always export this way.

Both processes must see both GPUs (the decode process maps memory of the prefill GPU): run them
with the same devices visible, e.g. CUDA_VISIBLE_DEVICES=0,1 for prefill and 1,0 for decode, each
then using its own first device. GPUs are matched by UUID, not by index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import torch

from radixmesh.common.errors import invalid_argument, unsupported
from radixmesh.engine.disagg import kv_io
from radixmesh.engine.disagg.transport.base import DEFAULT_CHUNK_BYTES, BaseKVTransport, PendingReceive, dtype_name
from radixmesh.engine.disagg.transport.ipc import CudaIpc, contiguous_strides
from radixmesh.engine.disagg.transport.ipc_direct import DirectExporter, DirectReceiver, DirectRef
from radixmesh.engine.disagg.transport.registry import CUDA_IPC_MODES
from radixmesh.engine.memory import TokenToKVPool
from radixmesh.wire.disagg import KVChunk

if TYPE_CHECKING:
    from radixmesh.engine.disagg.transport.choice import ReceiverInfo


class IpcHandle(msgspec.Struct, tag="staging", frozen=True):
    """What the decode side needs to open a staging buffer (torch's `_share_cuda_` fields)."""

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
_decoder = msgspec.msgpack.Decoder(IpcHandle | DirectRef)


class CudaIpcKVTransport(BaseKVTransport):
    transport_id = "cuda-ipc"
    device_types = ("cuda",)

    def __init__(self, pool: TokenToKVPool, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES, mode: str = "direct") -> None:
        if pool.device.type != "cuda":
            raise unsupported("the cuda-ipc KV transport needs the KV pool on a CUDA device", "kv_transport")
        if mode not in CUDA_IPC_MODES:
            raise invalid_argument(f"unknown cuda-ipc mode {mode!r}; choose one of {', '.join(CUDA_IPC_MODES)}",
                                   "mode")
        super().__init__(pool, max_chunk_bytes)
        from radixmesh.engine.distributed.kv_pool import ShardedKVPool

        self.mode = mode
        self._ipc = CudaIpc()
        direct = mode == "direct" and not isinstance(pool, ShardedKVPool)
        self._exporter = DirectExporter(pool, self._ipc) if direct else None
        self._receiver = DirectReceiver(pool, self._ipc)
        self._staging: dict[str, torch.Tensor] = {}
        self._opened: list[torch.Tensor] = []

    def export(self, transfer_id: str, slots: torch.Tensor, receiver: ReceiverInfo | None = None) -> list[KVChunk]:
        pool = self.pool
        ref = self._exporter.export(transfer_id, slots) if self._exporter is not None else None
        if ref is None:
            return self._export_staged(transfer_id, slots)
        num_tokens = int(slots.shape[0])
        num_bytes = num_tokens * pool.num_layers * self.layer_token_bytes
        return [KVChunk(self.transport_id, 0, pool.num_layers, num_tokens, dtype_name(pool.dtype),
                        _encoder.encode(ref), num_bytes)]

    def release(self, transfer_id: str) -> None:
        self._staging.pop(transfer_id, None)  # torch keeps the block until the decode side let go
        if self._exporter is not None:
            self._exporter.release(transfer_id)

    def receive(self, chunk: KVChunk, slots: torch.Tensor, host_slots: Any = None) -> PendingReceive | None:
        self.check_chunk(chunk, slots.shape[0])
        try:
            ref = _decoder.decode(chunk.data)
        except msgspec.DecodeError as exc:  # ValidationError too
            raise invalid_argument(f"unreadable cuda-ipc chunk ({exc}): do both workers run the same version?",
                                   "kv_transport") from exc
        if isinstance(ref, DirectRef):
            if (chunk.layer_begin, chunk.layer_end) != (0, self.pool.num_layers):
                raise invalid_argument(f"a direct cuda-ipc chunk covers layers [{chunk.layer_begin}, "
                                       f"{chunk.layer_end}), not all {self.pool.num_layers}")
            self._receiver.receive(ref, slots)
        else:
            self._receive_staged(chunk, ref, slots)
        return None  # queued on the device: in the pool once `finish` synchronized

    def finish(self) -> None:
        torch.cuda.synchronize(self.pool.device)
        self._opened.clear()  # drops our references: the prefill side may free its staging buffers
        self._receiver.finished()

    def _export_staged(self, transfer_id: str, slots: torch.Tensor) -> list[KVChunk]:
        pool, num_tokens = self.pool, slots.shape[0]
        shape = kv_io.packed_shape(pool, pool.num_layers, num_tokens)
        staging = torch.empty(shape, dtype=pool.dtype, device=pool.device)
        kv_io.gather(pool, slots, staging)
        self._staging[transfer_id] = staging
        # records an event after the gather, which the decode side's copy waits for
        dev, ipc, size, offset, ref_handle, ref_offset, event, sync = staging.untyped_storage()._share_cuda_()
        handle = IpcHandle(self._ipc.device_uuid(pool.device), dev, ipc, size, offset, ref_handle, ref_offset, event,
                           sync, list(shape))
        num_bytes = staging.numel() * staging.element_size()
        return [KVChunk(self.transport_id, 0, pool.num_layers, num_tokens, dtype_name(pool.dtype),
                        _encoder.encode(handle), num_bytes)]

    def _receive_staged(self, chunk: KVChunk, handle: IpcHandle, slots: torch.Tensor) -> None:
        shape = kv_io.packed_shape(self.pool, chunk.layer_end - chunk.layer_begin, chunk.num_tokens)
        if tuple(handle.shape) != shape:
            raise invalid_argument(f"the shared KV buffer is {tuple(handle.shape)}, expected {shape}")
        remote = self._open_staged(handle)
        local = remote.to(self.pool.device, non_blocking=True)  # device to device (peer copy)
        self._opened.append(remote)
        kv_io.scatter(self.pool, slots, local, chunk.layer_begin)

    def _open_staged(self, handle: IpcHandle) -> torch.Tensor:
        local_index = self._ipc.local_device(handle.device_uuid).index
        with torch.cuda.device(local_index):
            storage = torch.UntypedStorage._new_shared_cuda(
                local_index, handle.handle, handle.storage_size_bytes, handle.storage_offset_bytes,
                handle.ref_counter_handle, handle.ref_counter_offset, handle.event_handle,
                handle.event_sync_required)
            tensor = torch.empty(0, dtype=self.pool.dtype, device=f"cuda:{local_index}")
            tensor.set_(storage, 0, handle.shape, contiguous_strides(handle.shape))
        return tensor
