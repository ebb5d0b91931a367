"""Disaggregated routing: after the policy picked a decode worker D by cache and load, pick the
prefill worker P that computes the prompt for it.

P is chosen among available prefill workers by the same kind of policy, run as its own
instance (its own speculative entries and approximate tree), so that P is scored by the
prompt it caches and its load, which for a prefill worker is its queued prefill tokens. A
prompt with fewer than `min_prefill_tokens` tokens uncached on D (a short prompt, or the next
turn of a conversation D holds) skips P: D computes those few tokens itself, as it does when
no prefill worker is available.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeVar

from radixmesh.router import metrics
from radixmesh.router.config import DisaggConfig
from radixmesh.router.policies.base import BaseRoutingPolicy, RouteRequest, RoutingDecision
from radixmesh.router.workers import WorkerRegistry

T = TypeVar("T")
SERVING_ROLES = ("unified", "decode")
"""Roles that take a whole Generate call from the router (prefill workers only take Prefill calls)."""
PD_REASONS = ("prefill-tier", "short-prompt", "no-prefill-worker")
"""RoutingDecision.pd_reason of a decision for a decode worker."""


class PrefillPlanner:
    """Names a prefill worker for decisions that chose a decode worker (see the module docstring)."""

    def __init__(self, config: DisaggConfig, registry: WorkerRegistry, policy: BaseRoutingPolicy) -> None:
        self.config = config
        self.registry = registry
        self.policy = policy
        for reason in PD_REASONS:  # the series exist before the first decision
            metrics.PD_DECISIONS.labels(reason)

    async def plan(self, request: RouteRequest, decision: RoutingDecision) -> None:
        """Set `decision.prefill` and `decision.pd_reason` when the chosen worker is a decode worker."""
        if decision.worker.role != "decode":
            return
        uncached = request.num_prompt_tokens - decision.cached_tokens.get(decision.worker.worker_id, 0)
        candidates = self.registry.available("prefill")
        if uncached < self.config.min_prefill_tokens:
            decision.pd_reason = "short-prompt"
        elif not candidates:
            decision.pd_reason = "no-prefill-worker"
        else:
            decision.prefill = await self.policy.choose(request, candidates)
            decision.pd_reason = "prefill-tier"
        metrics.PD_DECISIONS.labels(decision.pd_reason).inc()

    async def on_routed(self, request: RouteRequest, decision: RoutingDecision) -> None:
        if decision.prefill is not None:
            await self.policy.on_routed(request, decision.prefill)

    async def track(self, request: RouteRequest, decision: RoutingDecision,
                    stream: AsyncIterator[T]) -> AsyncIterator[T]:
        """`stream` with the prefill worker's in-flight work counted until the decode worker's first message
        (by then the prefill is over), so that a burst spreads over prefill workers before their next poll."""
        prefill = decision.prefill
        if prefill is None:
            async for item in stream:
                yield item
            return
        worker = prefill.worker
        uncached = max(0, request.num_prompt_tokens - prefill.cached_tokens.get(worker.worker_id, 0))
        is_trial = worker.begin_request(uncached)
        ended = False
        try:
            async for item in stream:
                if not ended:
                    ended = True
                    worker.end_request(uncached, first_token_seen=False)
                yield item
        finally:
            if not ended:
                worker.end_request(uncached, first_token_seen=False)
            if is_trial:
                worker.breaker.end_trial()  # the router sees no verdict on the prefill worker's part

    async def start(self) -> None:
        await self.policy.start()

    async def close(self) -> None:
        await self.policy.close()
