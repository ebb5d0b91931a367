"""The router side of the index: which worker holds how much of a prompt's block chain.

A lookup reads the chain in pipelined rounds (a few blocks first, more per round) and
stops at the first block that no live worker holds, or once no worker's prefix continues.
An entry counts only if its worker has a live lease of the same epoch; stale entries are
queued for conditional deletion, malformed ones are logged and skipped. A speculative
entry (written right after a routing decision) counts as held by its worker until it
expires, so a burst of a new prefix follows the first request before the worker reports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from radixmesh.index.config import IndexConfig
from radixmesh.index.janitor import IndexJanitor
from radixmesh.index.keys import IndexKeys
from radixmesh.index.lease import WorkerLease, parse_lease

logger = logging.getLogger(__name__)

FIRST_ROUND_BLOCKS = 16
MAX_ROUND_BLOCKS = 256
MAX_STALE_QUEUE = 4096


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
    """worker id -> blocks it holds in total, for every live worker."""

    def blocks_of(self, worker_id: str) -> int:
        return self.cached_blocks.get(worker_id, 0)

    def tokens_of(self, worker_id: str) -> int:
        return self.blocks_of(worker_id) * self.block_size


@dataclass
class _Malformed:
    count: int = 0
    last_log_s: float = 0.0


class KVIndexReader:
    """Reads the index for routing; safe to share between concurrent requests of one event loop."""

    def __init__(self, config: IndexConfig, redis: Redis) -> None:
        self.config = config
        self.redis = redis
        self.keys = IndexKeys(config.namespace)
        self.janitor = IndexJanitor(redis, self.keys)
        self._leases: dict[str, WorkerLease] = {}
        self._leases_read_s = float("-inf")
        self._stale: dict[tuple[str, str], set[str]] = {}  # (worker, epoch value) -> block keys
        self._malformed = _Malformed()

    # ---- leases ------------------------------------------------------------------------------
    async def live_leases(self, max_age_s: float | None = None) -> dict[str, WorkerLease]:
        """worker id -> its lease, for every worker whose lease exists and parses; cached briefly."""
        max_age_s = self.config.lease_cache_s if max_age_s is None else max_age_s
        if time.monotonic() - self._leases_read_s <= max_age_s:
            return self._leases
        ids = sorted(_text(m) for m in await self.redis.smembers(self.keys.workers))
        pipe = self.redis.pipeline(transaction=False)
        for wid in ids:
            pipe.get(self.keys.lease(wid))
        leases = {}
        for wid, raw in zip(ids, await pipe.execute() if ids else []):
            lease = parse_lease(wid, raw)
            if lease is not None:
                leases[wid] = lease
        self._leases, self._leases_read_s = leases, time.monotonic()
        return leases

    # ---- lookups -----------------------------------------------------------------------------
    async def lookup(self, block_hashes: Sequence[int]) -> PrefixMatch:
        """Per live worker, the number of leading blocks of `block_hashes` it holds (and its footprint).

        The first round also reads every live worker's total block count, so a new prefix needs
        no second round trip to be placed by footprint.
        """
        leases = await self.live_leases()
        live = sorted(leases)
        counts: dict[str, int] = {}
        speculative: set[str] = set()
        footprint: dict[str, int] = {}
        start, size = 0, FIRST_ROUND_BLOCKS
        while True:
            chunk = block_hashes[start:start + size]
            pipe = self.redis.pipeline(transaction=False)
            for h in chunk:
                pipe.hgetall(self.keys.block(h))
                pipe.get(self.keys.speculative(h))
            if start == 0:
                for w in live:
                    pipe.scard(self.keys.worker_blocks(w, leases[w].epoch))
            replies = await pipe.execute()
            if start == 0:
                footprint = {w: int(n) for w, n in zip(live, replies[2 * len(chunk):])}
            if not self._extend(chunk, start, replies, leases, counts, speculative):
                break
            start += len(chunk)
            if start >= len(block_hashes):
                break
            size = min(size * 4, MAX_ROUND_BLOCKS)
        return PrefixMatch(len(block_hashes), self.config.block_size, counts, frozenset(speculative), footprint)

    def _extend(self, chunk: Sequence[int], start: int, replies: list[Any], leases: dict[str, WorkerLease],
                counts: dict[str, int], speculative: set[str]) -> bool:
        """Advance every worker's prefix over one round's blocks; False once no prefix continues."""
        for offset, h in enumerate(chunk):
            holders = self._holders(h, replies[2 * offset], leases)
            spec = _text(replies[2 * offset + 1])
            if spec and spec in leases and spec not in holders:
                holders.add(spec)
                speculative.add(spec)
            index = start + offset
            extended = [w for w in holders if counts.get(w, 0) == index]
            if not extended:
                return False
            for w in extended:
                counts[w] = index + 1
        return True

    def _holders(self, block_hash: int, entries: dict[bytes, bytes], leases: dict[str, WorkerLease]) -> set[str]:
        holders = set()
        for raw_worker, raw_epoch in entries.items():
            worker, epoch_text = _text(raw_worker), _text(raw_epoch)
            try:
                epoch = int(epoch_text)
            except ValueError:
                self._log_malformed(block_hash, worker, epoch_text)
                continue
            lease = leases.get(worker)
            if lease is not None and lease.epoch == epoch:
                holders.add(worker)
            elif lease is None or epoch < lease.epoch:
                self._queue_stale(worker, epoch_text, self.keys.block(block_hash))
        return holders

    async def record_speculative(self, block_hashes: Sequence[int], worker_id: str, from_block: int = 0) -> None:
        """Mark blocks [from_block:] as about to be held by `worker_id` (short-lived)."""
        if from_block >= len(block_hashes):
            return
        pipe = self.redis.pipeline(transaction=False)
        for h in block_hashes[from_block:]:
            pipe.set(self.keys.speculative(h), worker_id, px=self.config.speculative_ttl_ms)
        await pipe.execute()

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


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value
