"""Block events of a radix cache as they cross processes: which full token blocks it stores and evicts (keys as
in `block_hash`); the scheduler process records them (radixmesh.engine.kv_events), a worker publishes them to the
KV-cache index."""

from __future__ import annotations

import msgspec


class BlocksStored(msgspec.Struct, tag="stored", frozen=True):
    block_hashes: list[int]
    """Keys of blocks the cache now holds, parents before children."""
    tier: str = "device"
    """Where their KV is now: device (the GPU pool) | host (the hierarchical cache's host tier). A block
    stored again with another tier moved between tiers."""


class BlocksRemoved(msgspec.Struct, tag="removed", frozen=True):
    block_hashes: list[int]
    """Keys of blocks the cache no longer holds."""


class AllBlocksCleared(msgspec.Struct, tag="cleared", frozen=True):
    pass


KVEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


class KVEventsMsg(msgspec.Struct, tag="kv_events", frozen=True):
    """Block events of one scheduler step, in the order they happened."""

    events: list[KVEvent]
    block_size: int
    """Tokens per block the hashes were computed with."""
