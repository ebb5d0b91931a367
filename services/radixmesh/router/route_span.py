"""What the `router.route` span records about one routing decision: the policy's choice and why,
and for every candidate its score, the prompt tokens it is believed to cache, and its load."""

from __future__ import annotations

from collections.abc import Sequence

from radixmesh.router.policies.base import RouteRequest, RoutingDecision
from radixmesh.router.workers import WorkerHandle

AttributeValue = str | int | float


def route_attributes(request: RouteRequest, decision: RoutingDecision, candidates: Sequence[WorkerHandle],
                     attempt: int = 1) -> dict[str, AttributeValue]:
    """decision.attributes() plus the request's size, the attempt (2+: a retry on another worker) and each
    candidate's load as the router saw it."""
    attrs: dict[str, AttributeValue] = {
        "radixmesh.request_id": request.request_id, "routing.attempt": attempt,
        "routing.prompt_tokens": request.num_prompt_tokens,
        "routing.cached_blocks": decision.cached_blocks, "routing.block_size": request.block_size,
        **decision.attributes(),
    }
    attrs["routing.num_candidates"] = len(candidates)
    for worker in candidates:
        prefix = f"routing.candidate.{worker.worker_id}"
        load = worker.load
        attrs.setdefault(f"{prefix}.cached_tokens", decision.cached_tokens.get(worker.worker_id, 0))
        attrs.update({
            f"{prefix}.num_inflight": worker.num_inflight,
            f"{prefix}.inflight_prefill_tokens": worker.inflight_prefill_tokens,
            f"{prefix}.num_running_reqs": load.num_running_reqs,
            f"{prefix}.num_waiting_reqs": load.num_waiting_reqs,
            f"{prefix}.num_queued_prefill_tokens": load.num_queued_prefill_tokens,
            f"{prefix}.kv_usage": round(load.kv_usage, 6),
        })
    return attrs
