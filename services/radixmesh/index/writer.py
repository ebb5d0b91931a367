"""The worker side of the index: publishes what the worker's radix cache holds, under a lease.

The writer mirrors the set of full blocks the cache holds, so it can always republish
everything. Incremental changes are queued and sent in pipelined batches. Any Redis
failure (or a lapsed lease) triggers a resync: a new epoch, the lease rewritten, the
whole mirror republished, and the old epoch's entries cleaned. Readers count only entries
of the lease's current epoch, so a resync never shows a mix of old and new state.

The lease also names the LoRA adapters the worker holds (`set_lora_adapters`): a change rewrites the lease at
once and moves the lease counter, so routers read the new list before their next lookup.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from redis import Redis as BlockingRedis
from redis.asyncio import Redis
from redis.exceptions import RedisError

from radixmesh.common import aio
from radixmesh.index.config import IndexConfig
from radixmesh.index.janitor import IndexJanitor
from radixmesh.index.keys import DEVICE_TIER, HOST_TIER, TIERS, IndexKeys
from radixmesh.index.lease import WorkerLease
from radixmesh.index.write_scripts import APPLY_EVENTS, pack_events

logger = logging.getLogger(__name__)

RETRY_S = 0.5
"""Pause after a failed Redis round trip before the next try."""


@dataclass(frozen=True)
class WriterIdentity:
    """Who the writer publishes as."""

    worker_id: str
    """The worker's stable id (host:port by default)."""
    address: str
    """host:port routers dial."""
    role: str = "unified"
    """unified | prefill | decode."""
    metrics_port: int = 0
    """Prometheus port to advertise (0: none)."""


def connect(config: IndexConfig) -> Redis:
    """An asyncio Redis client with the index's timeouts (connects lazily)."""
    return Redis.from_url(config.redis_url, socket_timeout=config.op_timeout_s,
                          socket_connect_timeout=config.op_timeout_s, health_check_interval=0)


def connect_inline(config: IndexConfig) -> BlockingRedis:
    """A blocking Redis client for inline lookups, with their short timeout (connects lazily)."""
    return BlockingRedis.from_url(config.redis_url, socket_timeout=config.inline_timeout_s,
                                  socket_connect_timeout=config.inline_timeout_s, health_check_interval=0)


class KVIndexWriter:
    """Publishes one worker's block events; `stored`/`removed`/`cleared` are cheap and never block."""

    def __init__(self, config: IndexConfig, identity: WriterIdentity, redis: Redis | None = None) -> None:
        self.config = config
        self.identity = identity
        self.keys = IndexKeys(config.namespace)
        self.redis = redis if redis is not None else connect(config)
        self.janitor = IndexJanitor(self.redis, self.keys)
        self._apply: Any = self.redis.register_script(APPLY_EVENTS)
        self.epoch = 0
        """Epoch of the entries in Redis; 0 until the first publish."""
        self.held: dict[int, str] = {}
        """Block hash -> the tier (device | host) this worker holds it in."""
        self._pending: list[tuple[int, str | None, str | None]] = []  # (hash, new tier, old tier), in event order
        self._needs_resync = True
        self._in_resync = False
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush_timer: asyncio.TimerHandle | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._last_error_log = 0.0
        self._started_ms = int(time.time() * 1000)
        self.lora_adapters: tuple[str, ...] = ()
        """LoRA adapters the lease names (sorted)."""
        self.max_loras_per_batch = 0
        """The lease's LoRA batch width (0: the worker serves no adapters)."""
        self._lease_dirty = False
        self._in_rewrite = False
        self.num_resyncs = 0
        self.num_flushed_events = 0
        self.num_lease_rewrites = 0

    # ---- events (called from the worker's receive loop) --------------------------------------
    def stored(self, block_hashes: Iterable[int], tier: str = DEVICE_TIER) -> None:
        """The blocks are held in `tier` now (new ones, or ones that moved from the other tier)."""
        assert tier in TIERS, f"unknown tier {tier!r}"
        for h in block_hashes:
            old = self.held.get(h)
            if old != tier:
                self.held[h] = tier
                self._pending.append((h, tier, old))
        self._maybe_wake()

    def removed(self, block_hashes: Iterable[int]) -> None:
        for h in block_hashes:
            old = self.held.pop(h, None)
            if old is not None:
                self._pending.append((h, None, old))
        self._maybe_wake()

    def cleared(self) -> None:
        """The cache was emptied: start a new epoch, which drops every old entry at once."""
        self.held.clear()
        self._pending.clear()
        self._needs_resync = True
        self._wake.set()

    def set_lora_adapters(self, names: Iterable[str], max_loras_per_batch: int) -> None:
        """The LoRA adapters the worker holds now (after a load, an unload or its start); a change rewrites the
        lease soon after (before the first publish: the first lease carries them)."""
        adapters = tuple(sorted(set(names)))
        if (adapters, max_loras_per_batch) == (self.lora_adapters, self.max_loras_per_batch):
            return
        self.lora_adapters, self.max_loras_per_batch = adapters, max_loras_per_batch
        self._lease_dirty = True
        self._wake.set()

    def _maybe_wake(self) -> None:
        if len(self._pending) >= self.config.max_batch_events:
            self._wake.set()
        elif self._pending and self._flush_timer is None and self._loop is not None:
            self._flush_timer = self._loop.call_later(self.config.flush_interval_s, self._wake.set)

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Start publishing in the background; a Redis that is down now is retried, never fatal."""
        assert not self._tasks, "writer already started"
        self._loop = asyncio.get_running_loop()
        self._wake.set()  # the first publish (a resync) at once
        self._tasks = [asyncio.create_task(self._flush_loop(), name="index-flush"),
                       asyncio.create_task(self._heartbeat_loop(), name="index-heartbeat")]

    async def wait_published(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything queued so far is in Redis (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._needs_resync or self._in_resync or self._pending or self._lease_dirty or self._in_rewrite:
            if time.monotonic() > deadline:
                return False
            self._wake.set()
            await asyncio.sleep(0.01)
        return True

    async def close(self, withdraw: bool = True) -> None:
        """Stop; with `withdraw`, delete the lease and this worker's entries (graceful shutdown)."""
        self._stopping = True
        self._wake.set()
        await aio.cancel_and_wait(*self._tasks)
        self._tasks = []
        if withdraw and self.epoch:
            try:
                await self.redis.delete(self.keys.lease(self.identity.worker_id))
                await self.janitor.clean_worker(self.identity.worker_id, keep_epoch=None)
                await self.redis.srem(self.keys.workers, self.identity.worker_id)
                await self.redis.incr(self.keys.lease_version)
            except RedisError as exc:
                logger.warning("index: could not withdraw worker %s: %s", self.identity.worker_id, exc)
        await self.redis.aclose()

    # ---- background --------------------------------------------------------------------------
    async def _flush_loop(self) -> None:
        # Sleeps until woken: by a full batch at once, else one flush interval after the first
        # queued event (so a burst goes out together), or by a clear, a resync or a waiter.
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            self._flush_timer = None
            try:
                if self._needs_resync:
                    await self._resync()
                if self._lease_dirty and not self._needs_resync:
                    await self._rewrite_lease()
                while self._pending and not self._needs_resync:
                    await self._flush_batch()
            except (RedisError, OSError) as exc:
                self._on_error(exc)
                await asyncio.sleep(RETRY_S)
                self._wake.set()

    async def _heartbeat_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.config.heartbeat_s)
            if self._needs_resync or not self.epoch:
                continue
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.set(self.keys.lease(self.identity.worker_id), self._lease(self.epoch).to_bytes(),
                         px=self.config.lease_ttl_ms, xx=True)
                pipe.sadd(self.keys.workers, self.identity.worker_id)
                alive, _ = await pipe.execute()
                if not alive:
                    logger.warning("index: lease of worker %s lapsed; republishing", self.identity.worker_id)
                    self._needs_resync = True
                    self._wake.set()
            except (RedisError, OSError) as exc:
                self._on_error(exc)

    def _on_error(self, exc: BaseException) -> None:
        # Writes may be lost and the lease may lapse while Redis is away: republish on return. The flush
        # loop is woken even when nothing else is queued (a failed heartbeat of an idle worker): it retries
        # every RETRY_S until Redis answers.
        self._needs_resync = True
        self._pending.clear()
        self._wake.set()
        now = time.monotonic()
        if now - self._last_error_log > 10.0:
            self._last_error_log = now
            logger.warning("index: Redis unavailable for worker %s (%s); will resync", self.identity.worker_id, exc)

    async def _resync(self) -> None:
        # A clear or an error during the awaits below sets _needs_resync again, for another round.
        self._needs_resync = False
        self._lease_dirty = False  # the new lease names the adapters
        self._pending.clear()
        snapshot = list(self.held.items())
        self._in_resync = True
        try:
            await self._publish_snapshot(snapshot)
        finally:
            self._in_resync = False

    async def _publish_snapshot(self, snapshot: list[tuple[int, str]]) -> None:
        wid = self.identity.worker_id
        epoch = int(await self.redis.incr(self.keys.epoch(wid)))
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.keys.lease(wid), self._lease(epoch).to_bytes(), px=self.config.lease_ttl_ms)
        pipe.sadd(self.keys.workers, wid)
        pipe.sadd(self.keys.worker_epochs(wid), str(epoch))
        pipe.incr(self.keys.lease_version)
        await pipe.execute()
        previous, self.epoch = self.epoch, epoch
        for start in range(0, len(snapshot), self.config.max_batch_events):
            await self._write([(h, tier, None) for h, tier in snapshot[start:start + self.config.max_batch_events]])
        self.num_resyncs += 1
        logger.info("index: worker %s published %d blocks in epoch %d (was %d)", wid, len(snapshot), epoch, previous)
        await self.janitor.clean_worker(wid, keep_epoch=epoch)

    async def _rewrite_lease(self) -> None:
        """The same epoch's lease with the current adapters; the counter moves so readers read it again."""
        self._lease_dirty = False
        wid = self.identity.worker_id
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.keys.lease(wid), self._lease(self.epoch).to_bytes(), px=self.config.lease_ttl_ms, xx=True)
        pipe.incr(self.keys.lease_version)
        self._in_rewrite = True
        try:
            alive, _ = await pipe.execute()
        finally:
            self._in_rewrite = False
        self.num_lease_rewrites += 1
        if not alive:
            logger.warning("index: lease of worker %s lapsed; republishing", wid)
            self._needs_resync = True
            self._wake.set()

    def _lease(self, epoch: int) -> WorkerLease:
        ident = self.identity
        return WorkerLease(ident.worker_id, epoch, ident.address, ident.role, self.config.block_size,
                           ident.metrics_port, self._started_ms, self.lora_adapters, self.max_loras_per_batch)

    async def _flush_batch(self) -> None:
        batch = self._pending[: self.config.max_batch_events]
        del self._pending[: len(batch)]
        await self._write(batch)

    async def _write(self, batch: list[tuple[int, str | None, str | None]]) -> None:
        """Apply `(hash, new tier or None when removed, old tier or None when new)` changes in order, in one
        script call (radixmesh.index.write_scripts)."""
        wid = self.identity.worker_id
        keys = [self.keys.tier_blocks(wid, self.epoch, tier) for tier in (DEVICE_TIER, HOST_TIER)]
        await self._apply(keys=keys, args=[self.keys.namespace, wid, str(self.epoch), pack_events(batch)])
        self.num_flushed_events += len(batch)
