"""cache-aware: the Redis KV-cache index (what workers really hold) plus load.

Index entries are keyed by the id a worker publishes under (`WorkerHandle.index_id`),
which the router maps back to its registry ids. After each decision the router writes a
short-lived speculative entry for the blocks the chosen worker does not hold yet.

Concurrent requests race their index lookups, so the policy also remembers its own
decisions for the same short time and merges them into every lookup (recorded before
any await, so the next request of a burst always sees the previous one's choice).

When Redis fails, the policy switches to its approx-tree (kept warm with every decision)
and probes Redis in the background; the first good probe switches back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

from redis.exceptions import RedisError

from radixmesh.common import aio
from radixmesh.index.reader import KVIndexReader
from radixmesh.router.config import RouterConfig
from radixmesh.router.peer_hint import plan_peer
from radixmesh.router.policies.approx_tree import ApproxTreePolicy
from radixmesh.router.policies.base import BaseRoutingPolicy, RouteRequest, RoutingDecision
from radixmesh.router.policies.scoring import decide
from radixmesh.router.workers import WorkerHandle

logger = logging.getLogger(__name__)

REDIS_ERRORS = (RedisError, OSError, asyncio.TimeoutError)
SPECULATIVE_WRITE_DELAY_S = 0.002
"""A decision's speculative index entry is written this long after it, so that its round trip does not share the
event loop with the start of that request's worker call (this router's own bursts see the decision at once through
`RecentDecisions`; other routers see it a couple of ms later)."""


class RecentDecisions:
    """block key -> (worker id, expiry) of this router's latest decisions: a local speculative index.

    Recording is on every request's path, so it is one C-level dict update; each decision's keys are also
    kept as one batch, and expired batches are dropped (the keys a later decision did not take over) when
    the next decision is recorded."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic, max_entries: int = 200_000) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self.max_entries = max_entries
        self._owner: dict[int, tuple[str, float]] = {}
        self._batches: deque[tuple[tuple[str, float], tuple[int, ...]]] = deque()
        """(owner entry, its keys) per decision, oldest first (one TTL: expiry order)."""

    def record(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        self._prune()
        entry = (worker_id, self.clock() + self.ttl_s)
        keys = tuple(block_hashes)
        self._owner.update(dict.fromkeys(keys, entry))
        self._batches.append((entry, keys))
        if len(self._owner) > self.max_entries:
            self._prune(force=True)

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks each worker was just sent (the chain as one owner per block)."""
        now = self.clock()
        counts: dict[str, int] = {}
        for i, h in enumerate(block_hashes):
            entry = self._owner.get(h)
            if entry is None or entry[1] < now or counts.get(entry[0], 0) != i:
                break
            counts[entry[0]] = i + 1
        return counts

    def _prune(self, force: bool = False) -> None:
        """Drop expired decisions (with `force`, the oldest until at most half of max_entries keys remain)."""
        now, owner = self.clock(), self._owner
        while self._batches:
            entry, keys = self._batches[0]
            if entry[1] >= now and not (force and len(owner) > self.max_entries // 2):
                return
            self._batches.popleft()
            for h in keys:
                if owner.get(h) is entry:
                    del owner[h]


class CacheAwarePolicy(BaseRoutingPolicy):
    policy_id = "cache-aware"

    def __init__(self, config: RouterConfig, reader: KVIndexReader | None = None, **_: object) -> None:
        self.config = config
        self.reader = reader
        self.fallback = ApproxTreePolicy(config)
        speculative_ttl_s = reader.config.speculative_ttl_s if reader is not None else 3.0
        self.recent = RecentDecisions(speculative_ttl_s)
        self.redis_up = reader is not None
        self._probe_task: asyncio.Task[None] | None = None
        self._sweep_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._warm_task: asyncio.Task[None] | None = None
        self.num_fallback_decisions = 0
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False
        if reader is None:
            logger.warning("router: cache-aware without --redis-url routes as approx-tree")

    def active_policy(self) -> str:
        return self.policy_id if self.redis_up else self.fallback.policy_id

    async def start(self) -> None:
        if self.reader is None:
            return
        # best effort: a failure here shows on the first lookup
        self._warm_task = asyncio.create_task(_quietly(self.reader.open_inline()), name="index-inline-connect")
        if self.config.sweep_interval_s > 0:
            self._sweep_task = asyncio.create_task(self._sweep_loop(), name="index-sweep")
        self._watch_task = asyncio.create_task(self._watch_while_up(self.reader), name="redis-watch")

    async def close(self) -> None:
        self._closed = True  # speculative writes still waiting for their delay are dropped
        await aio.cancel_and_wait(self._probe_task, self._sweep_task, self._watch_task, self._warm_task)
        self._probe_task = self._sweep_task = self._watch_task = self._warm_task = None

    async def choose(self, request: RouteRequest, candidates: Sequence[WorkerHandle]) -> RoutingDecision:
        if self.reader is not None and self.redis_up:
            try:
                return await self._choose_with_index(self.reader, request, candidates)
            except REDIS_ERRORS as exc:
                self._redis_failed(exc)
        self.num_fallback_decisions += 1
        return await self.fallback.choose(request, candidates)

    async def _choose_with_index(self, reader: KVIndexReader, request: RouteRequest,
                                 candidates: Sequence[WorkerHandle]) -> RoutingDecision:
        by_index = {(w.index_id or w.worker_id): w for w in candidates}
        match = await reader.lookup(request.block_hashes)
        cached = {by_index[i].worker_id: n for i, n in match.cached_blocks.items() if i in by_index}
        device = {w.worker_id: match.device_blocks_of(i) for i, w in by_index.items()}
        footprint = {by_index[i].worker_id: n for i, n in match.footprint.items() if i in by_index}
        ids = {w.worker_id for w in candidates}
        for worker_id, n in self.recent.match(request.block_hashes).items():
            if worker_id in ids:  # this router just sent the prefix there: it is computed on the device
                cached[worker_id] = max(cached.get(worker_id, 0), n)
                device[worker_id] = max(device.get(worker_id, 0), n)
        decision = decide(self.policy_id, request, candidates, cached, footprint, self.config.scoring, device)
        if self.config.peer_fetch_min_tokens > 0:
            leases = await reader.live_leases()  # cached: the lookup has just read them
            epochs = {w.worker_id: leases[i].epoch for i, w in by_index.items() if i in leases}
            decision.peer = plan_peer(request, decision, candidates, device, epochs,
                                      self.config.peer_fetch_min_tokens)
        self.recent.record(decision.worker.worker_id, request.block_hashes)
        return decision

    async def on_routed(self, request: RouteRequest, decision: RoutingDecision) -> None:
        if self.reader is None or not self.redis_up or decision.policy != self.policy_id:
            self.fallback.remember(request, decision)  # the fallback decided: its next decision must see this one
            return
        # Off the request's path (its worker call starts first): the fallback's tree, kept warm for an outage,
        # and the speculative entry; this router's own bursts are covered by `recent` at once.
        asyncio.get_running_loop().call_later(SPECULATIVE_WRITE_DELAY_S, self._after_routed, self.reader,
                                              request, decision)

    def _after_routed(self, reader: KVIndexReader, request: RouteRequest, decision: RoutingDecision) -> None:
        self.fallback.remember(request, decision)
        if self._closed:
            return
        task = asyncio.create_task(self._record_speculative(reader, request, decision))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _record_speculative(self, reader: KVIndexReader, request: RouteRequest,
                                  decision: RoutingDecision) -> None:
        worker = decision.worker
        try:
            await reader.record_speculative(request.block_hashes, worker.index_id or worker.worker_id,
                                            from_block=decision.cached_blocks)
        except REDIS_ERRORS as exc:
            self._redis_failed(exc)

    def _redis_failed(self, exc: BaseException) -> None:
        if not self.redis_up:
            return
        self.redis_up = False
        logger.warning("router: Redis unavailable (%s: %s); routing with approx-tree until it returns",
                       type(exc).__name__, exc)
        self._probe_task = asyncio.create_task(self._probe_until_up(), name="redis-probe")

    async def _watch_while_up(self, reader: KVIndexReader) -> None:
        """Ping Redis every probe interval while it is up, so a lost Redis is noticed without waiting
        for a request to fail on it (then `_probe_until_up` takes over until it returns)."""
        while True:
            await asyncio.sleep(self.config.redis_probe_s)
            if not self.redis_up:
                continue
            try:
                await aio.wait_for(reader.redis.ping(), max(self.config.redis_probe_s, 0.5))
            except REDIS_ERRORS as exc:
                self._redis_failed(exc)

    async def _probe_until_up(self) -> None:
        assert self.reader is not None
        while True:
            await asyncio.sleep(self.config.redis_probe_s)
            try:
                await self.reader.redis.ping()
                await self.reader.live_leases(max_age_s=0)
                await self.reader.open_inline()  # reconnected off the loop, not by the next request's lookup
            except REDIS_ERRORS:
                continue
            self.redis_up = True
            logger.warning("router: Redis is back; routing with cache-aware again")
            return

    async def _sweep_loop(self) -> None:
        assert self.reader is not None
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            if not self.redis_up:
                continue
            try:
                await self.reader.sweep()
            except REDIS_ERRORS as exc:
                logger.info("router: index sweep failed: %s", exc)


async def _quietly(opening: Awaitable[None]) -> None:
    try:
        await opening
    except REDIS_ERRORS as exc:
        logger.debug("router: could not open the inline index connection yet: %s", exc)
