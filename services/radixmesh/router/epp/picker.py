"""The pick: which worker's HTTP endpoint serves a request, by the router's own policy.

Candidates are the router's available unified workers (healthy, circuit closed) that serve HTTP (their GetLoad
reports an http_port), narrowed to the proxy's subset hint when it sends one. None left: UNAVAILABLE (the proxy
answers 503). All of them with `max_queue_per_worker` requests waiting: RESOURCE_EXHAUSTED (429, shed). Else
the policy chooses as it does for the router's own Generate calls (cache-aware: the prompt's blocks against the
KV-cache index, plus load), and is told of the pick (its speculative index entries and approximate tree).

A request naming a LoRA adapter (`lora_path`, `model: "base:adapter"`, or `model` a name some worker publishes as
an adapter) is narrowed first to the workers holding it, as the router's own Generate calls are
(radixmesh.router.adapters: loaded on the least loaded worker when the router knows its path; NOT_FOUND, a 404
naming it, when no worker holds it and the router cannot place it).

The picker never sees a request finish, only its ext_proc stream close; a pick counts as in flight on its
worker until then (`release`), which is what load scoring adds to the workers' polled figures. For shedding,
the picks sent to a worker since its last load report count as waiting on it, so a burst is shed before the
next report shows the queue.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.router import metrics as router_metrics
from radixmesh.router.adapters import AdapterAffinity
from radixmesh.router.epp import metrics
from radixmesh.router.epp.config import EppConfig
from radixmesh.router.policies.base import BaseRoutingPolicy, RouteRequest, RoutingDecision
from radixmesh.router.workers import WorkerHandle, WorkerRegistry
from radixmesh.wire.load import WorkerLoad


@dataclass(frozen=True)
class Pick:
    """A pick and what its request holds until its stream ends."""

    decision: RoutingDecision
    endpoints: tuple[str, ...]
    """HTTP endpoints (ip:port), the pick first, then its fallbacks."""
    uncached_tokens: int
    """Prompt tokens the pick is not believed to hold (its in-flight prefill work)."""

    @property
    def destination(self) -> str:
        """The header's and the metadata's value: the endpoints, comma-separated."""
        return ",".join(self.endpoints)


class EndpointPicker:
    """Picks over one registry with one policy (the router's own)."""

    def __init__(self, config: EppConfig, registry: WorkerRegistry, policy: BaseRoutingPolicy,
                 adapters: AdapterAffinity | None = None) -> None:
        self.config = config
        self.registry = registry
        self.policy = policy
        self.adapters = adapters
        """LoRA adapter affinity (the router's own); None: adapters are not looked at."""
        self._sent: dict[str, tuple[WorkerLoad, int]] = {}
        """worker id -> (the load report it was last seen with, picks sent to it since that report)."""

    def candidates(self, subset: frozenset[str] | None = None) -> list[WorkerHandle]:
        """Workers a pick may name: available, unified, serving HTTP, in `subset` (ip:port) when given."""
        ready = [w for w in self.registry.available("unified") if w.http_port]
        if subset is None:
            return ready
        return [w for w in ready if w.http_endpoint in subset]

    def adapter_of(self, model: str) -> str:
        """The LoRA adapter a request's model names: after the colon of "base:adapter", else the name itself when
        a worker publishes an adapter of that name; "" for the base model."""
        if not model or self.adapters is None:
            return ""
        if ":" in model:
            return model.split(":", 1)[1]
        leases = self.adapters.leases()
        published = (self.adapters.published(w, leases)[0] for w in self.registry.available("unified"))
        return model if any(model in names for names in published) else ""

    async def pick(self, request: RouteRequest, subset: frozenset[str] | None = None) -> Pick:
        """The pick for `request` (UNAVAILABLE or RESOURCE_EXHAUSTED as the module docstring says; NOT_FOUND for
        an adapter no worker holds)."""
        candidates = self.candidates(subset)
        if not candidates:
            metrics.PICKS.labels("unavailable").inc()
            raise RadixMeshError(ErrorCode.UNAVAILABLE, self._why_none(subset))
        if request.lora_name and self.adapters is not None:
            candidates = await self.adapters.narrow(request.lora_name, candidates)
        limit = self.config.max_queue_per_worker
        if limit and all(self.queued(w) >= limit for w in candidates):
            metrics.PICKS.labels("shed").inc()
            raise RadixMeshError(ErrorCode.RESOURCE_EXHAUSTED,
                                 f"every worker has {limit} or more requests waiting; try again later")
        start = time.perf_counter()
        decision = await self.policy.choose(request, candidates)
        router_metrics.DECISION.observe(time.perf_counter() - start)
        router_metrics.DECISIONS.labels(decision.policy, decision.reason, decision.worker.worker_id).inc()
        await self.policy.on_routed(request, decision)
        worker = decision.worker
        uncached = max(0, request.num_prompt_tokens - decision.cached_blocks * request.block_size)
        worker.begin_request(uncached)
        self._count_sent(worker)
        metrics.PICKS.labels("picked").inc()
        return Pick(decision, (worker.http_endpoint, *self._fallbacks(decision, candidates)), uncached)

    def release(self, pick: Pick) -> None:
        """The pick's request stream ended."""
        pick.decision.worker.end_request(pick.uncached_tokens, first_token_seen=False)

    def queued(self, worker: WorkerHandle) -> int:
        """Requests waiting on `worker`: its last report's, plus the picks sent to it since."""
        sent = self._sent.get(worker.worker_id)
        since = sent[1] if sent is not None and sent[0] is worker.load else 0
        return worker.load.num_waiting_reqs + since

    def _count_sent(self, worker: WorkerHandle) -> None:
        sent = self._sent.get(worker.worker_id)
        count = sent[1] + 1 if sent is not None and sent[0] is worker.load else 1
        self._sent[worker.worker_id] = (worker.load, count)
        if len(self._sent) > 4 * max(len(self.registry), 1):  # workers that left
            self._sent = {k: v for k, v in self._sent.items() if self.registry.get(k) is not None}

    def _fallbacks(self, decision: RoutingDecision, candidates: list[WorkerHandle]) -> list[str]:
        """The next best candidates by the decision's scores (then by id), as many as configured."""
        if not self.config.fallbacks:
            return []
        others = [w for w in candidates if w is not decision.worker]
        others.sort(key=lambda w: (-decision.scores.get(w.worker_id, 0.0), w.worker_id))
        return [w.http_endpoint for w in others[:self.config.fallbacks]]

    def _why_none(self, subset: frozenset[str] | None) -> str:
        workers = self.registry.all()
        if not workers:
            return "no worker discovered yet"
        ready = self.candidates()
        if not ready:
            serving = sum(1 for w in workers if w.http_port)
            return (f"none of {len(workers)} workers is ready to serve HTTP ({serving} report an HTTP port; "
                    "workers need --http-port)")
        assert subset is not None, "candidates exist without a subset"
        return (f"none of the {len(subset)} endpoints of the subset hint is a ready worker "
                f"({len(ready)} ready: {', '.join(sorted(w.http_endpoint for w in ready)[:3])}...)")
