"""The contract of a KV transport: how a prompt's KV leaves the prefill pool and lands in the decode pool.

Both ends run inside scheduler processes. Whatever a transport puts in `KVChunk.data` travels
in-band, in the workers' gRPC `Prefill` call: the KV itself (grpc), or a reference the
decode side fetches from (cuda-ipc: CUDA IPC handles; nixl: the prefill side's NIXL agent and where the
rows are in its registered memory). The prefill side keeps whatever backs its chunks until `release`.

A transport whose decode side moves the KV itself after `receive` returns (nixl's READ) hands back a
`PendingReceive`, which the reservation polls between scheduler steps instead of blocking in `finish`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.memory import TokenToKVPool
from radixmesh.wire.disagg import KVChunk

if TYPE_CHECKING:
    from radixmesh.engine.disagg.transport.choice import ReceiverInfo

DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024
"""Most KV bytes per in-band chunk (whole layers; a single layer may exceed it)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class PendingReceive(ABC):
    """A received chunk whose KV is still on its way into the pool (the decode side polls it, never blocks)."""

    lease_s: float | None = None
    """The exporting side keeps the KV this long after the reservation was granted, at the latest (None: no
    limit known). KV that landed later may have been overwritten there: the reservation rejects it."""

    @abstractmethod
    def poll(self) -> bool:
        """True once the KV is in the pool; raises RadixMeshError when the receive failed (nothing writes the
        slots any more then). Call again after True: it stays True."""

    @abstractmethod
    def cancel(self) -> bool:
        """Stop it: True when nothing writes the slots any more, False when it could not be stopped (poll it
        until it ends before the slots are reused)."""


class BaseKVTransport(ABC):
    """Moves KV between two pools of the same model (same layers, KV heads, head dim and dtype).

    Prefill side: `export(transfer_id, slots, receiver)` returns the in-band chunks of the KV at `slots`
    (prompt positions in order), covering every layer exactly once; `ready_to_send(transfer_id)` blocks
    until the peer may read what they describe (and may return the chunks final only then);
    `release(transfer_id)` drops what backs them once the decode side holds the KV (or the transfer was
    given up). `export` is called right behind the pass that wrote the KV, before the next one is
    launched: it queues device work but must not wait for the device.
    Decode side: `receive(chunk, slots, host_slots)` writes the chunk's layers into `slots` (one per
    token, distinct), or starts to and returns a `PendingReceive`; `finish()` returns once every
    received chunk is in the pool (device work done), so the prefill side may release.
    """

    transport_id: ClassVar[str]
    device_types: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    """Devices (torch device types) of the pools this transport moves KV between."""

    def __init__(self, pool: TokenToKVPool, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        assert max_chunk_bytes > 0, f"max_chunk_bytes must be positive, got {max_chunk_bytes}"
        self.pool = pool
        self.max_chunk_bytes = max_chunk_bytes

    @property
    def layer_token_bytes(self) -> int:
        """Bytes of K plus V of one token in one layer."""
        return 2 * self.pool.num_kv_heads * self.pool.head_dim * self.pool.dtype.itemsize

    def layer_groups(self, num_tokens: int) -> list[tuple[int, int]]:
        """Consecutive layer ranges of at most `max_chunk_bytes` each (at least one layer each)."""
        per_layer = max(self.layer_token_bytes * num_tokens, 1)
        step = max(1, self.max_chunk_bytes // per_layer)
        layers = self.pool.num_layers
        return [(begin, min(begin + step, layers)) for begin in range(0, layers, step)]

    def check_chunk(self, chunk: KVChunk, num_slots: int) -> None:
        """Raise INVALID_ARGUMENT when `chunk` cannot land in `num_slots` slots of this pool."""
        pool = self.pool
        if chunk.transport != self.transport_id:
            raise invalid_argument(f"a {chunk.transport} chunk reached the {self.transport_id} transport",
                                   "kv_transport")
        if chunk.num_tokens != num_slots:
            raise invalid_argument(f"the chunk has KV of {chunk.num_tokens} tokens; {num_slots} slots are reserved")
        if not 0 <= chunk.layer_begin < chunk.layer_end <= pool.num_layers:
            raise invalid_argument(f"the chunk's layers [{chunk.layer_begin}, {chunk.layer_end}) are outside "
                                   f"this model's {pool.num_layers}")
        if chunk.dtype != dtype_name(pool.dtype):
            raise invalid_argument(f"the chunk's KV is {chunk.dtype}; this pool holds {dtype_name(pool.dtype)} "
                                   "(run both workers with the same --dtype and --kv-cache-dtype)", "dtype")

    @abstractmethod
    def export(self, transfer_id: str, slots: torch.Tensor, receiver: ReceiverInfo | None = None) -> list[KVChunk]:
        """The in-band chunks of the KV at `slots` [num_tokens] int64 (on the pool's device), for a receiver that
        described itself with `receiver` (None: unknown)."""

    def ready_to_send(self, transfer_id: str) -> list[KVChunk] | None:
        """Block until the peer may read what the chunks of `transfer_id` describe (called right before they
        are sent); returns the chunks to send when they are final only now, None to send `export`'s."""
        return None

    def release(self, transfer_id: str) -> None:  # noqa: B027
        """The transfer is over: free what backs its chunks (no-op when nothing does)."""

    @abstractmethod
    def receive(self, chunk: KVChunk, slots: torch.Tensor, host_slots: npt.NDArray[np.int64] | None = None
                ) -> PendingReceive | None:
        """Write the chunk's KV into `slots` [num_tokens] int64 (None: in the pool once `finish` returns), or
        start to (a PendingReceive); raise RadixMeshError when it does not fit or cannot start. `host_slots`:
        the same slots on the host, when the caller has them (a transport that needs them reads `slots`
        otherwise, which waits for the device)."""

    def finish(self) -> None:  # noqa: B027
        """Block until every `receive` so far is complete in the pool."""

    def progress(self) -> None:  # noqa: B027
        """Called once per scheduler iteration: advance what the transport's library does not advance itself."""

    def stats(self) -> dict[str, Any]:
        """Counters of what this transport holds (registrations, buffers in use), for leak checks."""
        return {}
