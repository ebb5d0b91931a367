"""cuda-ipc's direct mode: the decode GPU pulls a prompt's KV rows straight out of the prefill worker's pool.

Prefill side (`DirectExporter`): the pool's per-layer K and V buffers and a persistent int64 slot ring are
shared with CUDA IPC once. An export copies the prompt's slot indices into a region of the ring (on the
current stream, so behind the pass that wrote their KV), records an interprocess event after that copy and
describes both in a `DirectRef`; `release` frees the region. Nothing is gathered or allocated per transfer.

Decode side (`DirectReceiver`): maps a prefill pool and its ring once (the last few pools, so the mappings
of a restarted prefill worker go away), makes its stream wait on the event, then one `pull_kv_rows` launch
reads the ring and the rows over NVLink (or PCIe P2P) and writes them into the reserved slots. Without
peer access between the two GPUs, or into a sharded (TP) pool, the prefill pool is mapped for its own GPU
instead: the gather kernel runs there into a buffer that is copied over and scattered (correct, slower).

The prefill side keeps the slots (the export manager's radix lock) and the ring region until `release`,
which comes once the decode side's `finish` returned. A transfer read after its lease lapsed on the
prefill side would read whatever was written to those slots since: the lease must cover the transfer.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import torch

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.disagg import kv_io
from radixmesh.engine.disagg.transport.ipc import CudaIpc, SharedBuffer, on_device
from radixmesh.engine.disagg.transport.slot_ring import SlotRing
from radixmesh.engine.memory import TokenToKVPool

if TYPE_CHECKING:
    from radixmesh.kernels.kv_transfer import KVRowTable

logger = logging.getLogger(__name__)

MIN_RING_ENTRIES = 1 << 16
MAX_REMOTE_POOLS = 4
"""Prefill pools a decode worker keeps mapped (least recently used ones are unmapped past this)."""


class DirectRef(msgspec.Struct, tag="direct", frozen=True):
    """A direct-mode chunk's data: where the decode side reads the transfer's KV in the prefill pool."""

    device_uuid: str
    k_buffers: list[SharedBuffer]
    v_buffers: list[SharedBuffer]
    """Every layer's K and V buffer of the prefill pool, each `[num_rows, num_kv_heads, head_dim]`."""
    num_rows: int
    num_kv_heads: int
    head_dim: int
    ring: SharedBuffer
    """The slot ring: `[ring_len]` int64."""
    ring_len: int
    ring_offset: int
    """The transfer's prefill slots are `ring[ring_offset : ring_offset + num_tokens]`, in prompt order."""
    event_handle: bytes
    """Recorded after the slot copy: the decode side waits for it before reading."""

    @property
    def pool_key(self) -> tuple[str, bytes, int]:
        """Names the prefill pool (a restarted worker's pool has other handles)."""
        first = self.k_buffers[0]
        return self.device_uuid, first.handle, first.offset_bytes


def pool_device(pool: TokenToKVPool) -> torch.device:
    """The pool's device with its index, as its tensors report it (`pool.device` may be plain `cuda`)."""
    if pool.k_buffers:
        return pool.k_buffers[0].device
    if pool.device.type == "cuda" and pool.device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return pool.device


@dataclass
class _SharedPool:
    """The prefill pool and its slot ring, shared once."""

    uuid: str
    k_buffers: list[SharedBuffer]
    v_buffers: list[SharedBuffer]
    ring: torch.Tensor
    ring_shared: SharedBuffer
    regions: SlotRing


class DirectExporter:
    """Prefill side: exports describe slots of the shared pool (see the module doc)."""

    def __init__(self, pool: TokenToKVPool, ipc: CudaIpc) -> None:
        assert pool.k_buffers, "direct mode needs the pool's own buffers (not a sharded view)"
        self.pool, self.ipc = pool, ipc
        self.device = pool_device(pool)
        self._shared: _SharedPool | None = None
        self._events: dict[str, object] = {}
        """transfer id -> its event, kept until release (the decode side opens it)."""

    @property
    def ring_len(self) -> int:
        return max(2 * (self.pool.size + 1), MIN_RING_ENTRIES)

    def export(self, transfer_id: str, slots: torch.Tensor) -> DirectRef | None:
        """Describe the KV at `slots`; None when the ring has no room (or no slots): export another way."""
        num_tokens = int(slots.shape[0])
        shared = self._share()
        offset = shared.regions.allocate(transfer_id, num_tokens) if num_tokens else None
        if offset is None:
            return None
        with on_device(self.device):
            shared.ring[offset:offset + num_tokens].copy_(slots)  # the current stream: after the prefill pass
            event, event_handle = self.ipc.record_event(self.device)
        self._events[transfer_id] = event
        pool = self.pool
        return DirectRef(shared.uuid, shared.k_buffers, shared.v_buffers, pool.size + 1, pool.num_kv_heads,
                         pool.head_dim, shared.ring_shared, self.ring_len, offset, event_handle)

    def release(self, transfer_id: str) -> None:
        self._events.pop(transfer_id, None)
        if self._shared is not None:
            self._shared.regions.free(transfer_id)

    def _share(self) -> _SharedPool:
        if self._shared is None:
            ring = torch.zeros(self.ring_len, dtype=torch.int64, device=self.device)
            ipc = self.ipc
            self._shared = _SharedPool(ipc.device_uuid(self.device), [ipc.share(b) for b in self.pool.k_buffers],
                                       [ipc.share(b) for b in self.pool.v_buffers], ring, ipc.share(ring),
                                       SlotRing(self.ring_len))
        return self._shared


@dataclass
class _RemotePool:
    """A prefill pool and its ring mapped into this process, at `device`."""

    k_buffers: list[torch.Tensor]
    v_buffers: list[torch.Tensor]
    ring: torch.Tensor
    device: torch.device
    table: KVRowTable | None
    """None: the pool is mapped for its own GPU, read by a gather there (no peer access, or a sharded pool)."""


class DirectReceiver:
    """Decode side: pulls direct-mode transfers into this pool (see the module doc)."""

    def __init__(self, pool: TokenToKVPool, ipc: CudaIpc, max_remote_pools: int = MAX_REMOTE_POOLS) -> None:
        assert max_remote_pools >= 1, f"max_remote_pools must be at least 1, got {max_remote_pools}"
        self.pool, self.ipc, self.max_remote_pools = pool, ipc, max_remote_pools
        self.device = pool_device(pool)
        self._remotes: OrderedDict[tuple[str, bytes, int], _RemotePool] = OrderedDict()
        self._in_flight: list[object] = []
        """What this device's queued reads use (mappings, events, buffers): kept until `finished`."""

    @property
    def num_remote_pools(self) -> int:
        return len(self._remotes)

    def receive(self, ref: DirectRef, slots: torch.Tensor) -> None:
        """Queue the copy of the transfer's KV of every layer into `slots`; RadixMeshError when it cannot fit."""
        num_tokens = int(slots.shape[0])
        self._check(ref, num_tokens)
        remote = self._remote(ref)
        src_slots = remote.ring[ref.ring_offset:ref.ring_offset + num_tokens]
        self._in_flight.append(remote)
        if remote.table is None:
            self._gather_remote(remote, ref.event_handle, src_slots, slots)
            return
        from radixmesh.kernels.kv_transfer import pull_kv_rows

        with on_device(self.device):  # the current stream waits, then the kernel runs on it
            self._in_flight.append(self.ipc.wait_event(ref.event_handle, self.device))
            pull_kv_rows(remote.table, src_slots, slots)

    def finished(self) -> None:
        """The device is synchronized: drop what the reads used (evicted mappings close here)."""
        self._in_flight.clear()

    def _check(self, ref: DirectRef, num_tokens: int) -> None:
        pool = self.pool
        if len(ref.k_buffers) != pool.num_layers or len(ref.v_buffers) != pool.num_layers:
            raise invalid_argument(f"the prefill pool has {len(ref.k_buffers)} layers, this one {pool.num_layers}")
        if (ref.num_kv_heads, ref.head_dim) != (pool.num_kv_heads, pool.head_dim):
            raise invalid_argument(f"the prefill pool's rows are {ref.num_kv_heads} KV heads x {ref.head_dim}; "
                                   f"this pool's {pool.num_kv_heads} x {pool.head_dim} (run the same model)")
        if ref.num_rows < 1 or not 0 <= ref.ring_offset <= ref.ring_len - num_tokens:
            raise invalid_argument(f"the transfer's slots [{ref.ring_offset}, {ref.ring_offset + num_tokens}) are "
                                   f"outside the prefill side's ring of {ref.ring_len}")

    def _remote(self, ref: DirectRef) -> _RemotePool:
        key = ref.pool_key
        remote = self._remotes.get(key)
        if remote is None:
            remote = self._open(ref)
            self._remotes[key] = remote
            while len(self._remotes) > self.max_remote_pools:
                self._remotes.popitem(last=False)  # still referenced by _in_flight if reads are queued
        self._remotes.move_to_end(key)
        return remote

    def _open(self, ref: DirectRef) -> _RemotePool:
        from radixmesh.engine.distributed.kv_pool import ShardedKVPool

        remote_device = self.ipc.local_device(ref.device_uuid)
        can_pull = not isinstance(self.pool, ShardedKVPool) and self.ipc.can_access_peer(self.device, remote_device)
        device = self.device if can_pull else remote_device
        shape = (ref.num_rows, ref.num_kv_heads, ref.head_dim)
        k_buffers = [self.ipc.open(b, self.pool.dtype, shape, device) for b in ref.k_buffers]
        v_buffers = [self.ipc.open(b, self.pool.dtype, shape, device) for b in ref.v_buffers]
        ring = self.ipc.open(ref.ring, torch.int64, (ref.ring_len,), device)
        table = None
        if can_pull:
            from radixmesh.kernels.kv_transfer import make_kv_row_table

            table = make_kv_row_table(k_buffers, v_buffers, self.pool.k_buffers, self.pool.v_buffers)
        else:
            logger.warning("cuda-ipc: %s cannot read %s's memory (no peer access, or a sharded pool): its KV is "
                           "gathered there and copied over", self.device, remote_device)
        return _RemotePool(k_buffers, v_buffers, ring, device, table)

    def _gather_remote(self, remote: _RemotePool, event_handle: bytes, src_slots: torch.Tensor,
                       slots: torch.Tensor) -> None:
        from radixmesh.kernels.kv_transfer import gather_kv

        pool = self.pool
        with on_device(remote.device):
            self._in_flight.append(self.ipc.wait_event(event_handle, remote.device))
            packed = torch.empty(kv_io.packed_shape(pool, pool.num_layers, int(slots.shape[0])), dtype=pool.dtype,
                                 device=remote.device)
            gather_kv(remote.k_buffers, remote.v_buffers, src_slots, packed)
        local = packed.to(self.device, non_blocking=True)  # device to device, through the host without P2P
        self._in_flight += [packed, local]
        kv_io.scatter(pool, slots, local)
