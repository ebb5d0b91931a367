"""KV copies between the device pool and the host tier.

On CUDA both directions run on a dedicated copy stream, so PCIe traffic overlaps the forward passes:

    write (device -> host): gather the slots' KV into a token-major staging buffer on the compute stream
        (stream order makes freeing the device slots right after safe: later passes that reuse them run
        after the gather), then one DMA per run of consecutive host slots on the copy stream.
    load (host -> device): the DMAs into a staging buffer allocated on the copy stream; once its event has
        fired (polled, never waited on by the scheduler), `finish` scatters the staging buffer into the
        device slots on the compute stream, ahead of any pass that reads them.

All DMAs share one copy stream, so a host slot freed and handed out again is never written before an
earlier copy from it is done. On the CPU (the device pool in RAM) the copies are synchronous.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from radixmesh.engine.hicache.host_pool import HostKVPool, slot_runs
from radixmesh.engine.memory import TokenToKVPool
from radixmesh.kernels.kv_host_ref import gather_kv_tokens_torch, scatter_kv_tokens_torch


@dataclass
class TransferOp:
    """One batch of copies in one direction; `done()` polls without blocking."""

    kind: str
    """write (device to host) | load (host to device)."""
    num_tokens: int
    num_bytes: int
    started_s: float
    """time.perf_counter() when it was enqueued."""
    event: torch.cuda.Event | None = None
    """Fires when the DMAs are complete (None: already complete, the CPU path)."""
    staging: torch.Tensor | None = None
    """Keeps the staging buffer alive until the copies are done."""
    device_slots: torch.Tensor | None = None
    """load: where `finish` scatters the staging buffer."""
    finished: bool = field(default=False)
    done_s: float | None = None
    """time.perf_counter() when the copies were seen complete (at once on the CPU path)."""

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class HostTransfer:
    """Enqueues writes and loads between `device_pool` and `host_pool` (see the module docstring)."""

    def __init__(self, device_pool: TokenToKVPool, host_pool: HostKVPool) -> None:
        assert device_pool.dtype == host_pool.dtype, (
            f"host tier dtype {host_pool.dtype} differs from the device pool's {device_pool.dtype}")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.is_cuda = device_pool.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device_pool.device) if self.is_cuda else None

    def write(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> TransferOp:
        """Copy the KV at `device_slots` (device int64) to `host_slots` (CPU int64), slot for slot."""
        num = self._check(device_slots, host_slots)
        op = TransferOp("write", num, num * self.host_pool.bytes_per_token, time.perf_counter())
        pool, host = self.device_pool, self.host_pool
        staging = torch.empty((num, *host.token_shape), dtype=pool.dtype, device=pool.device)
        if not self.is_cuda:
            gather_kv_tokens_torch(pool.k_buffers, pool.v_buffers, device_slots, staging)
            host.buffer.index_copy_(0, host_slots, staging)
            op.done_s = time.perf_counter()
            return op
        from radixmesh.kernels.kv_host import gather_kv_tokens

        gather_kv_tokens(pool.k_buffers, pool.v_buffers, device_slots, staging)
        gathered = torch.cuda.Event()
        gathered.record()
        assert self.copy_stream is not None
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(gathered)
            offset = 0
            for first, length in slot_runs(host_slots):
                host.buffer[first:first + length].copy_(staging[offset:offset + length], non_blocking=True)
                offset += length
            op.event = torch.cuda.Event()
            op.event.record(self.copy_stream)
        op.staging = staging
        return op

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> TransferOp:
        """Start copying `host_slots` into `device_slots`; the KV is there once `finish(op)` ran on a done op."""
        num = self._check(device_slots, host_slots)
        op = TransferOp("load", num, num * self.host_pool.bytes_per_token, time.perf_counter(),
                        device_slots=device_slots)
        pool, host = self.device_pool, self.host_pool
        if not self.is_cuda:
            packed = host.buffer.index_select(0, host_slots)
            scatter_kv_tokens_torch(pool.k_buffers, pool.v_buffers, device_slots, packed)
            op.finished, op.done_s = True, time.perf_counter()
            return op
        assert self.copy_stream is not None
        with torch.cuda.stream(self.copy_stream):
            # allocated on the copy stream: a reused block is free on the stream that writes it
            staging = torch.empty((num, *host.token_shape), dtype=pool.dtype, device=pool.device)
            offset = 0
            for first, length in slot_runs(host_slots):
                staging[offset:offset + length].copy_(host.buffer[first:first + length], non_blocking=True)
                offset += length
            op.event = torch.cuda.Event()
            op.event.record(self.copy_stream)
        op.staging = staging
        return op

    def finish(self, op: TransferOp) -> None:
        """Make a done op's KV usable: a load scatters into its device slots (on the compute stream)."""
        assert op.done(), "finish() of a transfer that is still running"
        if op.done_s is None:
            op.done_s = time.perf_counter()
        if op.finished:
            return
        op.finished = True
        if op.kind == "load" and op.staging is not None:
            from radixmesh.kernels.kv_host import scatter_kv_tokens

            assert op.event is not None and op.device_slots is not None
            torch.cuda.current_stream().wait_event(op.event)
            pool = self.device_pool
            scatter_kv_tokens(pool.k_buffers, pool.v_buffers, op.device_slots, op.staging)
            op.staging.record_stream(torch.cuda.current_stream())  # freed only after the scatter ran
        op.staging = None

    def _check(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> int:
        assert device_slots.dim() == 1 and host_slots.dim() == 1, "slots must be 1-D"
        assert device_slots.numel() == host_slots.numel(), (
            f"{device_slots.numel()} device slots for {host_slots.numel()} host slots")
        assert host_slots.device.type == "cpu", f"host slots must be a CPU tensor, got {host_slots.device}"
        return int(device_slots.numel())
