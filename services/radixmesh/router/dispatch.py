"""Picks a worker per request and streams from it, retrying elsewhere before the first message and
migrating the stream to another worker after it.

Transport-independent: the caller passes `open_stream(worker, decision, attempt)`, which
returns the worker's response stream and raises `RadixMeshError` on failure. Failures
count against the worker's circuit breaker; an UNAVAILABLE worker is also marked
unhealthy at once (the health checker brings it back), and a DRAINING one is taken out of
routing without counting a failure. Before anything was forwarded a retryable failure is
retried on another worker after an exponential backoff with full jitter (none after a
DRAINING refusal). After that, a worker that died, drained or failed (UNAVAILABLE, DRAINING,
INTERNAL) starts a new leg of the stream on another worker, when the caller says the stream
can resume (`resumable`) and migration is on, up to --max-migrations times; the caller's
`open_stream` then asks that worker to continue from what was forwarded (see
radixmesh.router.migration). Otherwise the stream ends with the error, naming the worker.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from radixmesh.common import tracing
from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.index.reader import KVIndexReader
from radixmesh.router import metrics
from radixmesh.router.adapters import AdapterAffinity
from radixmesh.router.config import RouterConfig
from radixmesh.router.disagg import SERVING_ROLES, PrefillPlanner
from radixmesh.router.policies import create_policy
from radixmesh.router.policies.base import BaseRoutingPolicy, RouteRequest, RoutingDecision
from radixmesh.router.route_span import route_attributes
from radixmesh.router.workers import WorkerHandle, WorkerRegistry

logger = logging.getLogger(__name__)
T = TypeVar("T")

WORKER_POLL_S = 0.1
"""How often a request waiting for a healthy worker looks again."""
RETRYABLE = {ErrorCode.UNAVAILABLE, ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.INTERNAL, ErrorCode.DRAINING}
WORKER_FAULTS = {ErrorCode.UNAVAILABLE, ErrorCode.INTERNAL}
MIGRATION_REASONS = {ErrorCode.DRAINING: "drain", ErrorCode.UNAVAILABLE: "worker-lost",
                     ErrorCode.INTERNAL: "worker-error"}
"""Errors after the first item that move a stream to another worker, and their metric label."""
OpenStream = Callable[[WorkerHandle, RoutingDecision, int], AsyncIterator[T]]


class RequestRouter:
    """Routing plus retries over one registry and one policy."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry, policy: BaseRoutingPolicy,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 rng: Callable[[], float] = random.random, prefill_policy: BaseRoutingPolicy | None = None,
                 reader: KVIndexReader | None = None) -> None:
        self.config = config
        self.registry = registry
        self.policy = policy
        self.prefill = PrefillPlanner(config.disagg, registry, prefill_policy or create_policy(config.policy, config))
        """Names prefill workers for decode workers (disaggregation)."""
        self.sleep = sleep
        self.rng = rng
        self.inflight: dict[str, WorkerHandle] = {}
        """request id -> the worker running it (for Abort)."""
        self.adapters = AdapterAffinity(config.adapters, reader)
        """LoRA: a request of an adapter goes where it is loaded, as the index and GetLoad say (adapters.py)."""
        self.decision_s: list[float] = []
        """Recent routing-decision latencies (bounded), for benchmarks and metrics."""
        self.num_retries = 0
        self.num_migrations = 0
        for reason in metrics.MIGRATION_REASONS:  # the series exist before the first migration
            metrics.MIGRATIONS.labels(reason)

    async def select(self, request: RouteRequest, exclude: set[str] | frozenset[str] = frozenset(),
                     wait: bool | None = None) -> RoutingDecision:
        """The policy's decision among available workers not in `exclude`; UNAVAILABLE when there are none
        (after waiting up to wait_for_worker_s when `wait`, by default when nothing is excluded)."""
        candidates = await self._candidates(exclude, not exclude if wait is None else wait)
        if not candidates:
            known = len(self.registry)
            detail = f"{known} known, none healthy" if known else "none discovered"
            if exclude:
                detail += f"; already tried {', '.join(sorted(exclude))}"
            raise RadixMeshError(ErrorCode.UNAVAILABLE, f"no worker available ({detail})")
        candidates = await self.adapters.narrow(request.lora_name, candidates)
        start = time.perf_counter()
        with tracing.span("router.route") as span:
            decision = await self.policy.choose(request, candidates)
            await self.prefill.plan(request, decision)
            if span is not None:
                span.set_attributes(route_attributes(request, decision, candidates, attempt=len(exclude) + 1))
        self._record_latency(time.perf_counter() - start)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("route %s: %s", request.request_id, decision.attributes())
        return decision

    async def _candidates(self, exclude: set[str] | frozenset[str], wait: bool) -> list[WorkerHandle]:
        """Available workers not in `exclude`; with none and `wait`, polled for up to wait_for_worker_s."""
        polls = round(self.config.retry.wait_for_worker_s / WORKER_POLL_S) if wait else 0
        candidates = [w for w in self.registry.available(*SERVING_ROLES) if w.worker_id not in exclude]
        while not candidates and polls > 0:
            await self.sleep(WORKER_POLL_S)
            polls -= 1
            candidates = [w for w in self.registry.available(*SERVING_ROLES) if w.worker_id not in exclude]
        return candidates

    def backoff_s(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(max, base * 2^(attempt-1))]."""
        retry = self.config.retry
        return self.rng() * min(retry.max_backoff_s, retry.base_backoff_s * 2 ** (attempt - 1))

    async def stream(self, request: RouteRequest, open_stream: OpenStream[T],
                     on_decision: Callable[[RoutingDecision, int], None] | None = None,
                     resumable: Callable[[], bool] | None = None) -> AsyncGenerator[T, None]:
        """Route `request` and yield the chosen worker's stream; retried and migrated as the module docstring
        says. `resumable()`: the items yielded so far can be continued on another worker (the next
        `open_stream` call asks it to resume from them); None: the stream is never migrated."""
        legs = _Legs()
        while True:
            legs.attempt += 1
            legs.leg_attempt += 1
            decision = await self._select_leg(request, legs)
            if on_decision is not None:
                on_decision(decision, legs.attempt)
            await self.policy.on_routed(request, decision)
            await self.prefill.on_routed(request, decision)
            worker = decision.worker
            forwarded = False
            uncached = max(0, request.num_prompt_tokens - decision.cached_blocks * request.block_size)
            is_trial = worker.begin_request(uncached)
            self.inflight[request.request_id] = worker
            try:
                async for item in self.prefill.track(request, decision,
                                                     open_stream(worker, decision, legs.attempt)):
                    if not forwarded:
                        forwarded = True
                        worker.first_token(uncached)
                        legs.on_first_item()
                        if is_trial:  # a half-open trial passes with its first item: a long stream does not keep
                            worker.breaker.on_success()  # the worker out of routing (and of migrations) till its end
                            is_trial = False
                    yield item
                worker.breaker.on_success()
                return
            except RadixMeshError as exc:
                self._on_worker_error(worker, exc)
                if forwarded:
                    self._migrate(request, worker, exc, legs, resumable)
                    continue  # to another worker, from the tokens sent so far
                if exc.code not in RETRYABLE:
                    raise legs.failed(exc) from None
                legs.last_error = exc
                legs.tried.add(worker.worker_id)
            finally:
                worker.end_request(uncached, forwarded)
                if is_trial:
                    worker.breaker.end_trial()  # ended without a verdict (drained, caller gone): no stuck trial
                if self.inflight.get(request.request_id) is worker:
                    del self.inflight[request.request_id]
            await self._before_retry(request, worker, legs)

    async def _select_leg(self, request: RouteRequest, legs: _Legs) -> RoutingDecision:
        """The decision of the next try; the first try of a request or of a migration waits for a worker."""
        try:
            return await self.select(request, legs.tried, wait=legs.leg_attempt == 1)
        except RadixMeshError as exc:
            raise legs.failed(legs.last_error or exc) from None

    async def _before_retry(self, request: RouteRequest, worker: WorkerHandle, legs: _Legs) -> None:
        """After a failure before the first item: give up after max_attempts tries, else back off (not after a
        DRAINING refusal: the worker said why at once)."""
        assert legs.last_error is not None
        if legs.leg_attempt >= self.config.retry.max_attempts:
            raise legs.failed(legs.last_error)
        self.num_retries += 1
        logger.info("route %s: worker %s failed before the first token (%s); retrying",
                    request.request_id, worker.worker_id, legs.last_error)
        if legs.last_error.code is not ErrorCode.DRAINING:
            await self.sleep(self.backoff_s(legs.leg_attempt))

    def _migrate(self, request: RouteRequest, worker: WorkerHandle, exc: RadixMeshError, legs: _Legs,
                 resumable: Callable[[], bool] | None) -> None:
        """Start the next leg of a stream that broke after its first item, or raise why it cannot move."""
        reason = MIGRATION_REASONS.get(exc.code)
        migration = self.config.migration
        broke = RadixMeshError(exc.code, f"worker {worker.worker_id} failed mid-stream: {exc.message}", exc.param)
        if reason is None or not migration.enabled or resumable is None or not resumable():
            raise broke from exc
        if legs.migrations >= migration.max_per_request:
            raise RadixMeshError(exc.code, f"{broke.message} (after {legs.migrations} migrations, the most allowed)",
                                 exc.param) from exc
        legs.start_migration(worker.worker_id, broke)
        self.num_migrations += 1
        metrics.MIGRATIONS.labels(reason).inc()
        tracing.add_event("radixmesh.migration", {"radixmesh.migration.reason": reason,
                                                  "radixmesh.migration.from_worker": worker.worker_id,
                                                  "radixmesh.migration.number": legs.migrations})
        logger.info("route %s: worker %s %s mid-stream (%s); migrating (%d)", request.request_id, worker.worker_id,
                    "drained" if reason == "drain" else "failed", exc.message, legs.migrations)

    def _on_worker_error(self, worker: WorkerHandle, exc: RadixMeshError) -> None:
        if exc.code is ErrorCode.DRAINING:  # shutting down on purpose: no breaker failure, no new requests
            if worker.health.mark_down(exc.message):
                logger.warning("router: worker %s is draining", worker.worker_id)
        elif exc.code in WORKER_FAULTS:
            worker.breaker.on_failure()
            if exc.code is ErrorCode.UNAVAILABLE and worker.health.mark_down(exc.message):
                logger.warning("router: worker %s marked unhealthy: %s", worker.worker_id, exc.message)
        elif exc.code is not ErrorCode.RESOURCE_EXHAUSTED:
            worker.breaker.on_success()  # the worker answered; the request itself was bad

    def _record_latency(self, seconds: float) -> None:
        metrics.DECISION.observe(seconds)
        self.decision_s.append(seconds)
        if len(self.decision_s) > 10_000:
            del self.decision_s[:5_000]


class _Legs:
    """One routed request's tries: the legs of its stream (a migration starts a new one) and the tries of each."""

    def __init__(self) -> None:
        self.attempt = 0
        """Tries so far, all legs together (RoutingInfo.attempt)."""
        self.leg_attempt = 0
        """Tries of the current leg."""
        self.migrations = 0
        self.tried: set[str] = set()
        """Workers this leg must not go to."""
        self.last_error: RadixMeshError | None = None
        self.broke_at: float | None = None
        """perf_counter() of the break a migration answers, until the next leg's first item."""

    def start_migration(self, worker_id: str, error: RadixMeshError) -> None:
        self.migrations += 1
        self.leg_attempt = 0
        self.tried = {worker_id}
        self.last_error = error
        self.broke_at = time.perf_counter()

    def on_first_item(self) -> None:
        if self.broke_at is not None:
            metrics.MIGRATION_GAP.observe(time.perf_counter() - self.broke_at)
            self.broke_at = None

    def failed(self, exc: RadixMeshError) -> RadixMeshError:
        """The error that ends the request: `exc`, named as a mid-stream failure once the stream had moved."""
        if not self.migrations or "mid-stream" in exc.message:
            return exc
        return RadixMeshError(exc.code, f"the stream broke mid-stream and could not continue elsewhere: "
                                        f"{exc.message}", exc.param)
