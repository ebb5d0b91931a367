"""`nixl`: the decode side READs a prompt's KV out of the prefill worker's registered memory over NIXL (UCX).

Why READ (decode pulls) rather than WRITE (prefill pushes into the reserved slots): the decode side owns the
outcome. It posts the READ and polls its own handle, so "the KV is in my pool" needs no notification from
the peer, and a failed READ (the prefill worker died, or cannot be reached) is an error on the side that
falls back. The connection goes the way the Prefill call already does (decode dials prefill): a prefill
worker never needs to reach its decode workers. The prefill side only keeps the rows (the export's radix
lock) until the release, as for the other transports.

Each side registers its pool's per-layer K and V buffers once (VRAM on CUDA, DRAM on CPU) and one staging
buffer. An export describes the prompt's rows as runs of contiguous slots (`nixl_descs`): one descriptor per
run and layer, nothing copied. Rows too fragmented for that (the average descriptor below `min_run_bytes`)
are gathered into a region of the staging buffer first (one descriptor for the whole transfer); the
decode side likewise reads into its own slots, or into a staging region that it then scatters (the
kernels of `kv_io`). One chunk covers every layer: it carries the prefill agent's name, its metadata unless
the receiver said it holds it (`ReceiverInfo.nixl_agents`), and where the rows are.

The receive returns a `PendingRead` that the reservation polls between scheduler steps: a READ over TCP
takes long enough that blocking the decode loop on it would stall every running sequence.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch

from radixmesh.common.errors import ErrorCode, RadixMeshError, invalid_argument, unsupported
from radixmesh.engine.device_io import HostCopy
from radixmesh.engine.disagg import kv_io
from radixmesh.engine.disagg.transport import nixl_descs as descs
from radixmesh.engine.disagg.transport.base import DEFAULT_CHUNK_BYTES, BaseKVTransport, PendingReceive, dtype_name
from radixmesh.engine.disagg.transport.nixl_lib import NixlOptions, create_agent
from radixmesh.engine.disagg.transport.nixl_read import PendingRead, RemoteAgents, StagingBuffer
from radixmesh.engine.memory import TokenToKVPool
from radixmesh.wire.disagg import KVChunk

if TYPE_CHECKING:
    from radixmesh.engine.disagg.transport.choice import ReceiverInfo

logger = logging.getLogger(__name__)


class NixlRef(msgspec.Struct, frozen=True):
    """A nixl chunk's data: which agent holds the rows and where."""

    agent: str
    metadata: bytes
    """The agent's NIXL metadata; empty when the receiver holds it already."""
    mem_type: str
    """DRAM | VRAM"""
    device_id: int
    row_bytes: int
    """Bytes of one token's K (or V) in one layer."""
    k_addrs: list[int]
    v_addrs: list[int]
    """Pool layout: each layer's K and V buffer (empty: packed layout)."""
    runs: bytes
    """Pool layout: int64 (first slot, length) pairs, in prompt order."""
    packed_addr: int
    """Packed layout: where `[layers, 2, tokens, kv_heads, head_dim]` starts."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(NixlRef)


MIN_STAGING_BYTES = 64 * 2**20


def _staging_buffer(nbytes: int, device: torch.device) -> StagingBuffer:
    """The staging buffer, halved while the device cannot hold it (the KV pool took its share first): with
    less staging, fewer fragmented transfers are staged at once and the rest go row by row."""
    while True:
        try:
            return StagingBuffer(nbytes, device)
        except torch.OutOfMemoryError:
            if nbytes <= MIN_STAGING_BYTES:
                raise
            logger.warning("nixl: no room for a %.0f MiB staging buffer on %s; trying half", nbytes / 2**20, device)
            nbytes //= 2


@dataclass
class _Export:
    """An export whose chunk is made in `ready_to_send`."""

    rows: HostCopy
    """The slots on their way to the host."""
    offset: int | None
    """Where the rows were gathered in the staging buffer (None: not gathered)."""
    receiver: ReceiverInfo | None
    num_tokens: int


class NixlKVTransport(BaseKVTransport):
    transport_id = "nixl"

    def __init__(self, pool: TokenToKVPool, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 options: NixlOptions | None = None, mode: str | None = None) -> None:
        super().__init__(pool, max_chunk_bytes)
        from radixmesh.engine.distributed.kv_pool import ShardedKVPool

        options = options or NixlOptions.from_env()
        self.options = dataclasses.replace(options, mode=mode) if mode else options
        self.agent, self.name = create_agent(self.options.progress_thread)
        self.device = pool.k_buffers[0].device if pool.k_buffers else pool.device
        self.mem_type = "VRAM" if self.device.type == "cuda" else "DRAM"
        self.device_id = (self.device.index or 0) if self.device.type == "cuda" else 0
        self.can_direct = not isinstance(pool, ShardedKVPool)  # a TP pool's rows are on every rank: stage them
        self.min_run_bytes = self.options.min_run(self.device.type)
        pool_bytes = 2 * pool.num_layers * (pool.size + 1) * self.row_bytes
        self.staging = _staging_buffer(self.options.staging_size(self.device.type, pool_bytes), self.device)
        self.num_registrations = self._register()
        self.remotes = RemoteAgents(self.agent)
        self._exports: dict[str, _Export] = {}
        """Prefill side: transfer id -> what its chunk is made of once `ready_to_send` comes."""
        self._reads: list[PendingRead] = []
        self._num_reads = 0
        self._scattering: list[tuple[str, Any]] = []
        """Decode side: staging regions scattered on the device, freed once their event completed."""
        self._counters = {"nixl_exports_direct": 0, "nixl_exports_staged": 0, "nixl_reads_direct": 0,
                          "nixl_reads_staged": 0, "nixl_reads_failed": 0, "nixl_metadata_sent": 0}
        logger.info("nixl: agent %s registered %d %s buffers (%.0f MiB of KV pool, %.0f MiB staging); mode %s",
                    self.name, self.num_registrations, self.mem_type, pool_bytes / 2**20, self.staging.nbytes / 2**20,
                    self.options.mode)

    @property
    def row_bytes(self) -> int:
        return self.pool.num_kv_heads * self.pool.head_dim * self.pool.dtype.itemsize

    def _register(self) -> int:
        regions = [self.staging.tensor]
        if self.can_direct:
            regions += [*self.pool.k_buffers, *self.pool.v_buffers]
        for buf in regions:
            assert buf.is_contiguous() and buf.device == self.device, "registered buffers are contiguous on one device"
        table = np.array([(b.data_ptr(), b.numel() * b.element_size(), self.device_id) for b in regions],
                         dtype=np.uint64)
        try:
            self.agent.register_memory(table, self.mem_type)
        except Exception as exc:
            raise unsupported(f"NIXL could not register the KV pool's {self.mem_type} ({exc})", "kv_transport") from exc
        return len(regions)

    # ---- prefill side -----------------------------------------------------------------------------
    def export(self, transfer_id: str, slots: torch.Tensor, receiver: ReceiverInfo | None = None) -> list[KVChunk]:
        """Queue what the chunk needs without waiting for the device: the slots' copy to the host (their runs
        decide the layout) and, unless the mode is direct, their gather into a staging region. The chunk is
        final in `ready_to_send`."""
        pool, num_tokens = self.pool, int(slots.shape[0])
        offset = None
        if self.options.mode != "direct" or not self.can_direct:
            offset = self.staging.allocate(transfer_id, 2 * pool.num_layers * num_tokens * self.row_bytes)
            if offset is None and not self.can_direct:
                raise RadixMeshError(ErrorCode.RESOURCE_EXHAUSTED, f"the nixl staging buffer ({self.staging.nbytes} "
                                                                   "bytes) has no room for this transfer")
        if offset is not None:
            kv_io.gather(pool, slots, self.staging.view(offset, kv_io.packed_shape(pool, pool.num_layers, num_tokens),
                                                        pool.dtype))
        rows = HostCopy([slots])  # its event is behind the gather too: waiting for it waits for both
        self._exports[transfer_id] = _Export(rows, offset, receiver, num_tokens)
        return [self._chunk(num_tokens, b"")]

    def ready_to_send(self, transfer_id: str) -> list[KVChunk] | None:
        export = self._exports.pop(transfer_id, None)
        if export is None:
            return None
        pool = self.pool
        host = export.rows.wait()[0]  # the gather ran too
        assert host is not None, "a host copy of the slots"
        rows = host.numpy().astype(np.int64)
        staged = export.offset is not None and (not self.can_direct or self._should_stage(rows))
        if export.offset is not None and not staged:
            self.staging.free(transfer_id)  # the rows' runs are long: described in place, the gather unused
        holds_ours = export.receiver is not None and self.name in export.receiver.nixl_agents
        metadata = b"" if holds_ours else self.agent.get_agent_metadata()
        self._counters["nixl_metadata_sent"] += 1 if metadata else 0
        if staged:
            assert export.offset is not None
            ref = NixlRef(self.name, metadata, self.mem_type, self.device_id, self.row_bytes, [], [], b"",
                          self.staging.address + export.offset)
        else:
            starts = descs.run_starts(rows)
            lengths = np.diff(np.concatenate([starts, [rows.shape[0]]]))
            runs = np.stack([rows[starts], lengths], axis=1).astype(np.int64).tobytes()
            ref = NixlRef(self.name, metadata, self.mem_type, self.device_id, self.row_bytes,
                          [b.data_ptr() for b in pool.k_buffers], [b.data_ptr() for b in pool.v_buffers], runs, 0)
        self._counters["nixl_exports_staged" if staged else "nixl_exports_direct"] += 1
        return [self._chunk(export.num_tokens, _encoder.encode(ref))]

    def _chunk(self, num_tokens: int, data: bytes) -> KVChunk:
        pool = self.pool
        return KVChunk(self.transport_id, 0, pool.num_layers, num_tokens, dtype_name(pool.dtype), data,
                       2 * pool.num_layers * num_tokens * self.row_bytes)

    def _should_stage(self, rows: descs.Array, src_rows: descs.Array | None = None) -> bool:
        """Whether rows (joint with `src_rows` on the receiving side) are too fragmented for descriptors."""
        mode = self.options.mode
        if mode != "auto" or rows.shape[0] == 0:
            return mode == "staging"
        num_runs = descs.run_starts(rows).shape[0] if src_rows is None else descs.num_joint_runs(src_rows, rows)
        return rows.shape[0] * self.row_bytes / max(num_runs, 1) < self.min_run_bytes

    def release(self, transfer_id: str) -> None:
        self._exports.pop(transfer_id, None)
        self.staging.free(transfer_id)

    # ---- decode side ------------------------------------------------------------------------------
    def receive(self, chunk: KVChunk, slots: torch.Tensor, host_slots: descs.Array | None = None
                ) -> PendingReceive | None:
        self.check_chunk(chunk, int(slots.shape[0]))
        ref = self._decode(chunk)
        self.remotes.ensure(ref.agent, ref.metadata)
        num_layers, num_tokens, rb = self.pool.num_layers, chunk.num_tokens, self.row_bytes
        if ref.k_addrs:
            src_rows = descs.expand_runs(np.frombuffer(ref.runs, dtype=np.int64).reshape(-1, 2))
            remote = descs.pool_space(ref.k_addrs, ref.v_addrs, src_rows, ref.device_id)
        else:
            remote = descs.packed_space(ref.packed_addr, num_layers, num_tokens, rb, ref.device_id)
        if remote.rows.shape[0] != num_tokens:
            raise invalid_argument(f"the nixl chunk describes {remote.rows.shape[0]} rows for {num_tokens} tokens")
        dst_rows = host_slots if host_slots is not None else slots.detach().cpu().numpy().astype(np.int64)
        self._num_reads += 1
        key = f"read-{self._num_reads}"
        offset = self._read_layout(key, remote.rows, dst_rows)
        if offset is None:
            local = descs.pool_space([b.data_ptr() for b in self.pool.k_buffers],
                                     [b.data_ptr() for b in self.pool.v_buffers], dst_rows, self.device_id)
        else:
            local = descs.packed_space(self.staging.address + offset, num_layers, num_tokens, rb, self.device_id)
        return self._post(ref, local, remote, key if offset is not None else None, offset, slots, chunk.lease_s)

    def _decode(self, chunk: KVChunk) -> NixlRef:
        try:
            ref = _decoder.decode(chunk.data)
        except msgspec.DecodeError as exc:
            raise invalid_argument(f"unreadable nixl chunk ({exc}): do both workers run the same version?",
                                   "kv_transport") from exc
        if (chunk.layer_begin, chunk.layer_end) != (0, self.pool.num_layers):
            raise invalid_argument(f"a nixl chunk covers layers [{chunk.layer_begin}, {chunk.layer_end}), not all "
                                   f"{self.pool.num_layers}")
        if ref.row_bytes != self.row_bytes:
            raise invalid_argument(f"the prefill pool's rows are {ref.row_bytes} bytes, this pool's {self.row_bytes} "
                                   "(run the same model with the same --kv-cache-dtype)")
        if ref.k_addrs and (len(ref.k_addrs) != self.pool.num_layers or len(ref.v_addrs) != self.pool.num_layers):
            raise invalid_argument(f"the prefill pool has {len(ref.k_addrs)} layers, this one {self.pool.num_layers}")
        return ref

    def _read_layout(self, key: str, src_rows: descs.Array, dst_rows: descs.Array) -> int | None:
        """The staging offset to READ into (then scatter), or None: straight into the slots."""
        if self.can_direct and not self._should_stage(dst_rows, src_rows):
            return None
        offset = self.staging.allocate(key, 2 * self.pool.num_layers * dst_rows.shape[0] * self.row_bytes)
        if offset is None and not self.can_direct:
            raise RadixMeshError(ErrorCode.RESOURCE_EXHAUSTED, "the nixl staging buffer has no room for this transfer")
        return offset

    def _post(self, ref: NixlRef, local: descs.RowSpace, remote: descs.RowSpace, key: str | None,
              offset: int | None, slots: torch.Tensor, lease_s: float) -> PendingRead:
        local_descs, remote_descs = descs.read_descriptors(local, remote, self.row_bytes)
        agent = self.agent
        try:
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local_descs, self.mem_type),
                                           agent.get_xfer_descs(remote_descs, ref.mem_type), ref.agent)
            status = agent.transfer(handle)
        except Exception as exc:  # an unreachable or vanished peer, or descriptors it does not hold
            if key is not None:
                self.staging.free(key)
            self.remotes.forget(ref.agent)
            self._counters["nixl_reads_failed"] += 1
            raise RadixMeshError(ErrorCode.UNAVAILABLE, f"the NIXL READ from {ref.agent} could not start "
                                                        f"({type(exc).__name__}: {exc})") from exc
        if status == "ERR":
            agent.release_xfer_handle(handle)
            if key is not None:
                self.staging.free(key)
            self._counters["nixl_reads_failed"] += 1
            raise RadixMeshError(ErrorCode.UNAVAILABLE, f"the NIXL READ from {ref.agent} failed at once")

        def done(read: PendingRead) -> None:
            self._reads.remove(read)
            if key is not None and offset is not None:
                self._scatter(key, offset, slots)
            self._counters["nixl_reads_staged" if key is not None else "nixl_reads_direct"] += 1

        def failed(read: PendingRead, error: str) -> None:
            self._reads.remove(read)
            if key is not None:
                self.staging.free(key)  # nothing writes it any more
            if read.state == "failed":
                self._counters["nixl_reads_failed"] += 1
                self.remotes.forget(ref.agent)

        read = PendingRead(agent, handle, ref.agent, lease_s if lease_s > 0 else None, done, failed)
        self._reads.append(read)
        self._reap()
        return read

    def _scatter(self, key: str, offset: int, slots: torch.Tensor) -> None:
        pool = self.pool
        packed = self.staging.view(offset, kv_io.packed_shape(pool, pool.num_layers, int(slots.shape[0])), pool.dtype)
        kv_io.scatter(pool, slots, packed)
        if self.device.type != "cuda":
            self.staging.free(key)
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._scattering.append((key, event))  # later READs must not land in the region before this ran

    def _reap(self) -> None:
        while self._scattering and self._scattering[0][1].query():
            self.staging.free(self._scattering.pop(0)[0])

    def finish(self) -> None:
        for read in list(self._reads):
            read.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._reap()

    def progress(self) -> None:
        if not self.options.progress_thread:
            try:
                self.agent.get_new_notifs()  # progresses the UCX worker: peers' READs and connection setup
            except Exception as exc:  # a peer's failure shows on its READ; progress itself goes on
                logger.debug("nixl: progress: %s", exc)

    def receiver_agents(self) -> list[str]:
        """The prefill agents whose metadata this side holds (for `ReceiverInfo.nixl_agents`)."""
        return self.remotes.names

    def stats(self) -> dict[str, Any]:
        self._reap()
        return {**self._counters, "nixl_registrations": self.num_registrations,
                "nixl_staging_regions": self.staging.num_regions, "nixl_reads_in_flight": len(self._reads),
                "nixl_remote_agents": len(self.remotes.names)}
