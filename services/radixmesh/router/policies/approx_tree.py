"""approx-tree: cache-aware routing from the router's own decisions, without Redis.

Each worker gets an approximate prefix tree of the prompts routed to it. Block keys are
chained (a key names its whole prefix), so a per-worker set of keys is exactly a radix
tree over blocks: a prompt's match on a worker is the number of leading keys in its set.
Each set is bounded and forgets the least recently routed blocks first, standing in for
the worker's own LRU eviction. It is also the fallback the cache-aware policy keeps warm
for when Redis is down.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from radixmesh.router.config import RouterConfig
from radixmesh.router.policies.base import BaseRoutingPolicy, RouteRequest, RoutingDecision
from radixmesh.router.policies.scoring import decide
from radixmesh.router.workers import WorkerHandle


class ApproxPrefixIndex:
    """worker id -> LRU set of block keys routed to it."""

    def __init__(self, max_blocks_per_worker: int) -> None:
        assert max_blocks_per_worker >= 1, "max_blocks_per_worker must be >= 1"
        self.max_blocks_per_worker = max_blocks_per_worker
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def match(self, block_hashes: Sequence[int], worker_ids: Iterable[str]) -> dict[str, int]:
        """Leading blocks of the chain each worker is believed to hold (0 entries omitted)."""
        counts = {}
        for worker_id in worker_ids:
            held = self._blocks.get(worker_id)
            if not held:
                continue
            n = 0
            for h in block_hashes:
                if h not in held:
                    break
                n += 1
            if n:
                counts[worker_id] = n
        return counts

    def insert(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        held = self._blocks.setdefault(worker_id, OrderedDict())
        for h in block_hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_blocks_per_worker:
            held.popitem(last=False)

    def footprint(self, worker_ids: Iterable[str]) -> dict[str, int]:
        return {w: len(self._blocks.get(w, ())) for w in worker_ids}

    def forget(self, worker_id: str) -> None:
        self._blocks.pop(worker_id, None)

    def retain(self, worker_ids: Iterable[str]) -> None:
        keep = set(worker_ids)
        for worker_id in [w for w in self._blocks if w not in keep]:
            del self._blocks[worker_id]


class ApproxTreePolicy(BaseRoutingPolicy):
    policy_id = "approx-tree"

    def __init__(self, config: RouterConfig, **_: object) -> None:
        self.scoring = config.scoring
        self.index = ApproxPrefixIndex(config.scoring.approx_blocks_per_worker)

    async def choose(self, request: RouteRequest, candidates: Sequence[WorkerHandle]) -> RoutingDecision:
        ids = [w.worker_id for w in candidates]
        cached = self.index.match(request.block_hashes, ids)
        return decide(self.policy_id, request, candidates, cached, self.index.footprint(ids), self.scoring)

    async def on_routed(self, request: RouteRequest, decision: RoutingDecision) -> None:
        self.remember(request, decision)

    def remember(self, request: RouteRequest, decision: RoutingDecision) -> None:
        """The chosen worker now holds the prompt's blocks (the tree's guess)."""
        self.index.insert(decision.worker.worker_id, request.block_hashes)
