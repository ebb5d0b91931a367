"""Configuration of the KV-cache index, shared by its writers (workers) and readers (routers)."""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.common.errors import invalid_argument
from radixmesh.wire.block_hash import DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class IndexConfig:
    """Where the index lives in Redis and how fresh it is kept."""

    redis_url: str
    """redis://host:port/db of the shared Redis."""
    namespace: str = "radixmesh"
    """Prefix of every key, so several clusters can share one Redis."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per block; writers and readers of one namespace must agree."""
    lease_ttl_s: float = 10.0
    """A worker's lease lapses (and its entries are ignored) this long after its last heartbeat."""
    flush_interval_s: float = 0.02
    """Writers send queued block events at least this often."""
    max_batch_events: int = 2048
    """Writers send at once when this many block changes are queued."""
    speculative_ttl_s: float = 3.0
    """Lifetime of a router's speculative 'this worker will hold the prefix' entry."""
    lease_cache_s: float = 0.5
    """Readers reuse the set of live leases for this long before reading it again."""
    op_timeout_s: float = 1.0
    """Socket timeout of one Redis round trip; a slower Redis counts as down."""
    inline_timeout_s: float = 0.1
    """Socket timeout of an inline lookup (a blocking one, which holds the reader's event loop while it waits):
    a slower Redis counts as down, so a hung Redis stalls the loop at most this long before the fallback."""

    def __post_init__(self) -> None:
        if not self.redis_url:
            raise invalid_argument("the index needs a Redis URL", "redis_url")
        if self.block_size < 1:
            raise invalid_argument("block_size must be >= 1", "block_size")
        if min(self.lease_ttl_s, self.speculative_ttl_s, self.op_timeout_s, self.inline_timeout_s) <= 0:
            raise invalid_argument("lease_ttl_s, speculative_ttl_s, op_timeout_s and inline_timeout_s must be > 0",
                                   "lease_ttl_s")
        if self.flush_interval_s <= 0 or self.max_batch_events < 1 or self.lease_cache_s < 0:
            raise invalid_argument("flush_interval_s > 0, max_batch_events >= 1, lease_cache_s >= 0 required",
                                   "flush_interval_s")
        if ":" in self.namespace or not self.namespace:
            raise invalid_argument("namespace must be non-empty and contain no ':'", "namespace")

    @property
    def heartbeat_s(self) -> float:
        """Writers refresh their lease three times per TTL, so one lost heartbeat never lapses it."""
        return self.lease_ttl_s / 3

    @property
    def lease_ttl_ms(self) -> int:
        return max(1, int(self.lease_ttl_s * 1000))

    @property
    def speculative_ttl_ms(self) -> int:
        return max(1, int(self.speculative_ttl_s * 1000))
