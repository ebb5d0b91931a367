"""Policies that ignore the prompt: round-robin, random, and power-of-two choices by load."""

from __future__ import annotations

import random
from collections.abc import Sequence

from radixmesh.router.config import RouterConfig
from radixmesh.router.policies.base import BaseRoutingPolicy, RouteRequest, RoutingDecision
from radixmesh.router.policies.scoring import load_fraction, num_requests
from radixmesh.router.workers import WorkerHandle


class RoundRobinPolicy(BaseRoutingPolicy):
    """Each request to the next available worker in id order."""

    policy_id = "round-robin"

    def __init__(self, config: RouterConfig, **_: object) -> None:
        self._next = 0

    async def choose(self, request: RouteRequest, candidates: Sequence[WorkerHandle]) -> RoutingDecision:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        scores = {w.worker_id: 1.0 if w is chosen else 0.0 for w in candidates}
        return RoutingDecision(chosen, self.policy_id, self.policy_id, scores)


class RandomPolicy(BaseRoutingPolicy):
    """A uniformly random available worker."""

    policy_id = "random"

    def __init__(self, config: RouterConfig, **_: object) -> None:
        self._rng = random.Random(config.seed)

    async def choose(self, request: RouteRequest, candidates: Sequence[WorkerHandle]) -> RoutingDecision:
        chosen = self._rng.choice(list(candidates))
        scores = {w.worker_id: 1.0 if w is chosen else 0.0 for w in candidates}
        return RoutingDecision(chosen, self.policy_id, self.policy_id, scores)


class PowerOfTwoPolicy(BaseRoutingPolicy):
    """Two random workers; the less loaded one (fewer open requests, then lower load) wins."""

    policy_id = "power-of-two"

    def __init__(self, config: RouterConfig, **_: object) -> None:
        self.scoring = config.scoring
        self._rng = random.Random(config.seed)

    async def choose(self, request: RouteRequest, candidates: Sequence[WorkerHandle]) -> RoutingDecision:
        pair = self._rng.sample(list(candidates), min(2, len(candidates)))
        chosen = min(pair, key=lambda w: (num_requests(w), load_fraction(w, self.scoring)))
        scores = {w.worker_id: 1.0 - load_fraction(w, self.scoring) if w in pair else 0.0 for w in candidates}
        reason = self.policy_id if len(candidates) > 1 else "only-candidate"
        return RoutingDecision(chosen, self.policy_id, reason, scores)
