"""The router side of the index: which worker holds how much of a prompt's block chain.

A lookup walks the chain inside Redis in one round trip (a read-only Lua script) and
stops at the first block that no live worker holds, or once no worker's prefix continues.
An entry counts only if its worker has a live lease of the same epoch; stale entries are
queued for conditional deletion, malformed ones are logged and skipped. A speculative
entry (written right after a routing decision) counts as held by its worker until it
expires, so a burst of a new prefix follows the first request before the worker reports.

With an inline client the walk is a blocking call on the reader's event loop (one loopback round trip,
~0.15 ms for a prompt no worker holds): a router or gateway busy relaying token streams answers an awaited
reply only after the callbacks queued before it, which under load costs more than the walk itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis import Redis as BlockingRedis
from redis.asyncio import Redis

from radixmesh.index.chain_script import SCRIPT, ChainWalk, parse_lease_version, parse_reply
from radixmesh.index.config import IndexConfig
from radixmesh.index.janitor import IndexJanitor
from radixmesh.index.keys import IndexKeys
from radixmesh.index.lease import WorkerLease, parse_lease
from radixmesh.index.write_scripts import SET_SPECULATIVE, pack_hashes

logger = logging.getLogger(__name__)

MAX_STALE_QUEUE = 4096
BACKGROUND_READ_DELAY_S = 0.02
"""How long a background lease read waits, so that it does not share the event loop with the routing of the
request that found the cached set stale (its lookup, decision and worker call)."""


@dataclass(frozen=True)
class PrefixMatch:
    """How much of one prompt's full-block prefix each worker holds."""

    num_blocks: int
    """Full blocks in the prompt."""
    block_size: int
    """Tokens per block."""
    cached_blocks: dict[str, int] = field(default_factory=dict)
    """worker id -> leading blocks it holds (stored or speculative); absent means 0."""
    speculative: frozenset[str] = frozenset()
    """Workers whose count includes speculative entries."""
    footprint: dict[str, int] = field(default_factory=dict)
    """worker id -> blocks it holds in total (both tiers), for every live worker."""
    device_blocks: dict[str, int] | None = None
    """worker id -> leading blocks it holds on its device; the rest of `cached_blocks` is in its host tier
    (hierarchical cache). None: every cached block is on the device."""

    def blocks_of(self, worker_id: str) -> int:
        return self.cached_blocks.get(worker_id, 0)

    def device_blocks_of(self, worker_id: str) -> int:
        if self.device_blocks is None:
            return self.blocks_of(worker_id)
        return min(self.device_blocks.get(worker_id, 0), self.blocks_of(worker_id))

    def tokens_of(self, worker_id: str) -> int:
        return self.blocks_of(worker_id) * self.block_size


@dataclass
class _Malformed:
    count: int = 0
    last_log_s: float = 0.0


class KVIndexReader:
    """Reads the index for routing; safe to share between concurrent requests of one event loop."""

    def __init__(self, config: IndexConfig, redis: Redis, inline: BlockingRedis | None = None) -> None:
        self.config = config
        self.redis = redis
        self.inline = inline
        """A blocking client for the walk (None: the walk is awaited on `redis`)."""
        self.keys = IndexKeys(config.namespace)
        self.janitor = IndexJanitor(redis, self.keys)
        self._leases: dict[str, WorkerLease] = {}
        self._leases_read_s = float("-inf")
        self._lease_version = -1
        """The index's lease counter when `_leases` was read (-1: never read)."""
        self.num_lease_rereads = 0
        """Lookups that found the lease counter moved and read the leases again before answering."""
        self._stale: dict[tuple[str, str], set[str]] = {}  # (worker, epoch value) -> block keys
        self._malformed = _Malformed()
        self._walk: Any = redis.register_script(SCRIPT)
        self._walk_inline: Any = inline.register_script(SCRIPT) if inline is not None else None
        self._set_speculative: Any = redis.register_script(SET_SPECULATIVE)
        self._refresh: asyncio.Task[dict[str, WorkerLease]] | None = None

    # ---- leases ------------------------------------------------------------------------------
    async def live_leases(self, max_age_s: float | None = None) -> dict[str, WorkerLease]:
        """worker id -> its lease, for every worker whose lease exists and parses; cached briefly.

        A set older than `max_age_s` but younger than the lease TTL is returned as it is while a
        background read refreshes it (the routing path then costs one round trip, not three);
        an older one, or `max_age_s=0`, is read before returning.
        """
        max_age_s = self.config.lease_cache_s if max_age_s is None else max_age_s
        age_s = time.monotonic() - self._leases_read_s
        if age_s <= max_age_s:
            return self._leases
        if max_age_s > 0 and age_s <= max_age_s + self.config.lease_ttl_s:
            if self._refresh is None or self._refresh.done():
                self._refresh = asyncio.create_task(self._read_leases_later(), name="index-leases")
                self._refresh.add_done_callback(_log_refresh_failure)
            return self._leases
        return await self._read_leases()

    def cached_leases(self) -> dict[str, WorkerLease]:
        """The cached lease set without waiting (for a request's path, which must not stall on a Redis outage):
        a set older than `lease_cache_s` is read again in the background; one older than the lease TTL, or none
        read yet, is empty meanwhile."""
        age_s = time.monotonic() - self._leases_read_s
        if age_s <= self.config.lease_cache_s:
            return self._leases
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.create_task(self._read_leases_later(), name="index-leases")
            self._refresh.add_done_callback(_log_refresh_failure)
        return self._leases if age_s <= self.config.lease_cache_s + self.config.lease_ttl_s else {}

    async def _read_leases_later(self) -> dict[str, WorkerLease]:
        # Not alongside the lookup that found the set stale: that request's walk and worker call go first.
        await asyncio.sleep(BACKGROUND_READ_DELAY_S)
        return await self._read_leases()

    async def _read_leases(self) -> dict[str, WorkerLease]:
        # The counter is read first: a lease written after it makes the next lookup read them again.
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(self.keys.lease_version)
        pipe.smembers(self.keys.workers)
        version_raw, members = await pipe.execute()
        ids = sorted(_text(m) for m in members)
        pipe = self.redis.pipeline(transaction=False)
        for wid in ids:
            pipe.get(self.keys.lease(wid))
        leases = {}
        for wid, raw in zip(ids, await pipe.execute() if ids else []):
            lease = parse_lease(wid, raw)
            if lease is not None:
                leases[wid] = lease
        self._leases, self._leases_read_s = leases, time.monotonic()
        self._lease_version = parse_lease_version(version_raw)
        return leases

    # ---- lookups -----------------------------------------------------------------------------
    async def lookup(self, block_hashes: Sequence[int]) -> PrefixMatch:
        """Per live worker, the number of leading blocks of `block_hashes` it holds, and its footprint.

        One round trip: the walk runs in Redis (radixmesh.index.chain_script) and stops at the
        first block that no live worker holds. When the walk reports that a lease was written since the
        cached lease set was read (a worker started, restarted or republished after a Redis outage), the
        leases are read again and the chain walked again, so a lookup never misses a holder for a stale
        cache; that costs two more round trips once per lease change.
        """
        leases = await self.live_leases()
        walk = await self._walk_chain(block_hashes, leases)
        if walk.lease_version != self._lease_version:
            self.num_lease_rereads += 1
            leases = await self.live_leases(max_age_s=0)
            walk = await self._walk_chain(block_hashes, leases)
        for index, worker, value, tier in walk.odd:
            self._note_odd(block_hashes[index], worker, value, tier, leases)
        return PrefixMatch(len(block_hashes), self.config.block_size, walk.counts, frozenset(walk.speculative),
                           walk.footprint, walk.device_counts)

    async def _walk_chain(self, block_hashes: Sequence[int], leases: dict[str, WorkerLease]) -> ChainWalk:
        live = sorted(leases)
        keys = [key for w in live for key in (self.keys.worker_blocks(w, leases[w].epoch),
                                              self.keys.worker_host_blocks(w, leases[w].epoch))]
        args: list[str | int] = [self.keys.namespace, pack_hashes(block_hashes)]
        for w in live:
            args += [w, str(leases[w].epoch)]
        if self._walk_inline is not None:
            return parse_reply(self._walk_inline(keys=keys, args=args))
        return parse_reply(await self._walk(keys=keys, args=args))

    def _note_odd(self, block_hash: int, worker: str, value: str, tier: str, leases: dict[str, WorkerLease]) -> None:
        try:
            epoch = int(value)
        except ValueError:
            self._log_malformed(block_hash, worker, value)
            return
        lease = leases.get(worker)
        if lease is None or epoch < lease.epoch:
            self._queue_stale(worker, value, self.keys.tier_block(block_hash, tier))

    async def record_speculative(self, block_hashes: Sequence[int], worker_id: str, from_block: int = 0) -> None:
        """Mark blocks [from_block:] as about to be held by `worker_id` (short-lived)."""
        if from_block >= len(block_hashes):
            return
        await self._set_speculative(args=[self.keys.namespace, worker_id, self.config.speculative_ttl_ms,
                                          pack_hashes(block_hashes[from_block:])])

    # ---- cleanup -----------------------------------------------------------------------------
    def _queue_stale(self, worker: str, epoch_text: str, block_key: str) -> None:
        keys = self._stale.setdefault((worker, epoch_text), set())
        if sum(len(v) for v in self._stale.values()) < MAX_STALE_QUEUE:
            keys.add(block_key)

    async def clean_stale(self) -> int:
        """Delete the stale entries lookups came across (only where they still hold the stale epoch)."""
        stale, self._stale = self._stale, {}
        if not stale:
            return 0
        leases = await self.live_leases(max_age_s=0)  # the cached view may predate a worker's start
        removed = 0
        for (worker, epoch_text), block_keys in stale.items():
            lease = leases.get(worker)
            if lease is not None and lease.epoch <= int(epoch_text):
                continue
            removed += await self.janitor.delete_if_epoch(worker, epoch_text, sorted(block_keys))
        if removed:
            logger.info("index: removed %d stale entries found by lookups", removed)
        return removed

    async def sweep(self) -> int:
        """A full janitor pass against fresh leases (routers run this periodically)."""
        removed = await self.clean_stale()
        return removed + await self.janitor.sweep(await self.live_leases(max_age_s=0))

    def _log_malformed(self, block_hash: int, worker: str, value: str) -> None:
        self._malformed.count += 1
        now = time.monotonic()
        if now - self._malformed.last_log_s > 10.0:
            self._malformed.last_log_s = now
            logger.warning("index: ignoring malformed entry %s -> %r=%r (%d malformed so far)",
                           self.keys.block(block_hash), worker, value, self._malformed.count)

    @property
    def num_malformed(self) -> int:
        return self._malformed.count

    async def open_inline(self) -> None:
        """Open the blocking client's connection from a worker thread (name resolution and connect off the event
        loop), so that inline lookups find it open; a no-op without one. Raises the Redis error when it fails."""
        if self.inline is not None:
            await asyncio.to_thread(self.inline.ping)

    async def close(self) -> None:
        await self.redis.aclose()
        if self.inline is not None:
            self.inline.close()


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _log_refresh_failure(task: asyncio.Task[dict[str, WorkerLease]]) -> None:
    """A failed background lease read keeps the old set; the next inline read reports the error."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("index: background lease read failed: %s", task.exception())
