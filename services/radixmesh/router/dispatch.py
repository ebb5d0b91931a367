"""Picks a worker per request and streams from it, retrying elsewhere before the first message.

Transport-independent: the caller passes `open_stream(worker, decision, attempt)`, which
returns the worker's response stream and raises `RadixMeshError` on failure. Failures
count against the worker's circuit breaker; an UNAVAILABLE worker is also marked
unhealthy at once (the health checker brings it back). Before anything was forwarded a
retryable failure is retried on another worker after an exponential backoff with full
jitter; after that the stream ends with the error, naming the worker.
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
from radixmesh.router import metrics
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
RETRYABLE = {ErrorCode.UNAVAILABLE, ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.INTERNAL}
WORKER_FAULTS = {ErrorCode.UNAVAILABLE, ErrorCode.INTERNAL}
OpenStream = Callable[[WorkerHandle, RoutingDecision, int], AsyncIterator[T]]


class RequestRouter:
    """Routing plus retries over one registry and one policy."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry, policy: BaseRoutingPolicy,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 rng: Callable[[], float] = random.random, prefill_policy: BaseRoutingPolicy | None = None) -> None:
        self.config = config
        self.registry = registry
        self.policy = policy
        self.prefill = PrefillPlanner(config.disagg, registry, prefill_policy or create_policy(config.policy, config))
        """Names prefill workers for decode workers (disaggregation)."""
        self.sleep = sleep
        self.rng = rng
        self.inflight: dict[str, WorkerHandle] = {}
        """request id -> the worker running it (for Abort)."""
        self.decision_s: list[float] = []
        """Recent routing-decision latencies (bounded), for benchmarks and metrics."""
        self.num_retries = 0

    async def select(self, request: RouteRequest, exclude: set[str] | frozenset[str] = frozenset()) -> RoutingDecision:
        """The policy's decision among available workers not in `exclude`; UNAVAILABLE when there are none."""
        candidates = await self._candidates(exclude)
        if not candidates:
            known = len(self.registry)
            detail = f"{known} known, none healthy" if known else "none discovered"
            if exclude:
                detail += f"; already tried {', '.join(sorted(exclude))}"
            raise RadixMeshError(ErrorCode.UNAVAILABLE, f"no worker available ({detail})")
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

    async def _candidates(self, exclude: set[str] | frozenset[str]) -> list[WorkerHandle]:
        """Available workers not in `exclude`; on a first try with none, polled for up to wait_for_worker_s."""
        polls = 0 if exclude else round(self.config.retry.wait_for_worker_s / WORKER_POLL_S)
        candidates = [w for w in self.registry.available(*SERVING_ROLES) if w.worker_id not in exclude]
        while not candidates and polls > 0:
            await self.sleep(WORKER_POLL_S)
            polls -= 1
            candidates = self.registry.available(*SERVING_ROLES)
        return candidates

    def backoff_s(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(max, base * 2^(attempt-1))]."""
        retry = self.config.retry
        return self.rng() * min(retry.max_backoff_s, retry.base_backoff_s * 2 ** (attempt - 1))

    async def stream(self, request: RouteRequest, open_stream: OpenStream[T],
                     on_decision: Callable[[RoutingDecision, int], None] | None = None) -> AsyncGenerator[T, None]:
        """Route `request` and yield the chosen worker's stream; retried as the module docstring says."""
        tried: set[str] = set()
        last_error: RadixMeshError | None = None
        for attempt in range(1, self.config.retry.max_attempts + 1):
            try:
                decision = await self.select(request, tried)
            except RadixMeshError:
                if last_error is not None:
                    raise last_error from None
                raise
            if on_decision is not None:
                on_decision(decision, attempt)
            await self.policy.on_routed(request, decision)
            await self.prefill.on_routed(request, decision)
            worker = decision.worker
            forwarded = False
            uncached = max(0, request.num_prompt_tokens - decision.cached_blocks * request.block_size)
            worker.begin_request(uncached)
            self.inflight[request.request_id] = worker
            try:
                async for item in self.prefill.track(request, decision, open_stream(worker, decision, attempt)):
                    if not forwarded:
                        forwarded = True
                        worker.first_token(uncached)
                    yield item
                worker.breaker.on_success()
                return
            except RadixMeshError as exc:
                self._on_worker_error(worker, exc)
                if forwarded:
                    raise RadixMeshError(exc.code, f"worker {worker.worker_id} failed mid-stream: {exc.message}",
                                         exc.param) from exc
                if exc.code not in RETRYABLE:
                    raise
                last_error = exc
                tried.add(worker.worker_id)
            finally:
                worker.end_request(uncached, forwarded)
                if self.inflight.get(request.request_id) is worker:
                    del self.inflight[request.request_id]
            if attempt < self.config.retry.max_attempts:
                self.num_retries += 1
                logger.info("route %s: worker %s failed before the first token (%s); retrying",
                            request.request_id, worker.worker_id, last_error)
                await self.sleep(self.backoff_s(attempt))
        assert last_error is not None
        raise last_error

    def _on_worker_error(self, worker: WorkerHandle, exc: RadixMeshError) -> None:
        if exc.code in WORKER_FAULTS:
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
