"""Load and cache scoring shared by the cache-aware policies.

A worker's load is a fraction in [0, 1] mixing its queued prefill work, its running decode
tokens and its KV usage; the router's own in-flight requests are a floor under the polled
figures, so a burst is seen before the next poll. The score of a candidate is

    cached fraction of the prompt  -  load_weight * load

where a token cached in a worker's host tier (hierarchical cache) counts `host_hit_weight` of one
cached on its device: below a device hit, above a miss. The score is used except in two cases.
When the busiest worker has many more requests than the idlest (both
an absolute and a relative gap), load alone decides. When no worker holds at least
`cache_threshold` of the prompt, the prompt is a new prefix and goes to the least loaded
worker; ties go to the worker with the smallest cache footprint and then to a rendezvous
hash of the prompt's first block, so new prefixes spread even when requests come one at a
time, and every router sharing the index makes the same choice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from radixmesh.router.config import ScoringConfig
from radixmesh.router.policies.base import RouteRequest, RoutingDecision, rendezvous_rank
from radixmesh.router.workers import WorkerHandle

QUEUE_SHARE, DECODE_SHARE, KV_SHARE = 0.5, 0.3, 0.2


def num_requests(worker: WorkerHandle) -> int:
    polled = worker.load.num_running_reqs + worker.load.num_waiting_reqs
    return max(polled, worker.num_inflight)


def load_fraction(worker: WorkerHandle, scoring: ScoringConfig) -> float:
    load = worker.load
    queued = max(load.num_queued_prefill_tokens, worker.inflight_prefill_tokens)
    decode = load.num_running_decode_tokens / load.max_total_tokens if load.max_total_tokens else 0.0
    return (QUEUE_SHARE * min(1.0, queued / scoring.prefill_norm_tokens) + DECODE_SHARE * min(1.0, decode)
            + KV_SHARE * min(1.0, max(0.0, load.kv_usage)))


def is_imbalanced(candidates: Sequence[WorkerHandle], scoring: ScoringConfig) -> bool:
    counts = [num_requests(w) for w in candidates]
    busiest, idlest = max(counts), min(counts)
    return busiest - idlest > scoring.balance_abs_reqs and busiest > scoring.balance_rel * idlest


def decide(policy_id: str, request: RouteRequest, candidates: Sequence[WorkerHandle],
           cached_blocks: Mapping[str, int], footprint: Mapping[str, int], scoring: ScoringConfig,
           device_blocks: Mapping[str, int] | None = None) -> RoutingDecision:
    """The cache-aware decision given each candidate's cached leading blocks in either tier (keyed by
    worker_id) and, of those, the leading blocks on its device (None: all of them)."""
    key = request.routing_key
    loads = {w.worker_id: load_fraction(w, scoring) for w in candidates}
    tokens = {w.worker_id: min(request.num_prompt_tokens, cached_blocks.get(w.worker_id, 0) * request.block_size)
              for w in candidates}
    weighted: dict[str, float] = dict(tokens)
    if device_blocks is not None:
        for wid, held in tokens.items():
            on_device = min(held, device_blocks.get(wid, 0) * request.block_size)
            weighted[wid] = on_device + scoring.host_hit_weight * (held - on_device)
    prompt = max(request.num_prompt_tokens, 1)
    scores = {wid: weighted[wid] / prompt - scoring.load_weight * loads[wid] for wid in loads}

    def rank(w: WorkerHandle) -> int:
        return rendezvous_rank(key, w.index_id or w.worker_id)

    if len(candidates) > 1 and is_imbalanced(candidates, scoring):
        chosen = min(candidates, key=lambda w: (num_requests(w), loads[w.worker_id], -rank(w)))
        reason = "load-imbalance"
    elif max(weighted.values()) / prompt < scoring.cache_threshold:
        chosen = min(candidates, key=lambda w: (loads[w.worker_id], footprint.get(w.worker_id, 0), -rank(w)))
        reason = "new-prefix"
    else:
        chosen = max(candidates, key=lambda w: (scores[w.worker_id], rank(w)))
        reason = "cache-hit"
    if len(candidates) == 1:
        reason = "only-candidate"
    return RoutingDecision(chosen, policy_id, reason, scores, tokens, cached_blocks.get(chosen.worker_id, 0))
