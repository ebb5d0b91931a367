"""Decode: the running requests, retraction when KV runs out, and the new-token ratio admission reserves by.

Admission is optimistic: a running request is assumed to need only `new_token_ratio` times its remaining
`max_new_tokens` more slots. The ratio decays by a fixed step per decode batch while decoding goes well and
jumps back up when decode runs out of KV and retracts requests to the queue.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from radixmesh.engine.batch import ScheduleBatch, build_decode_batch
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.kv_manager import KVCacheManager
from radixmesh.engine.request import FinishReason, Req
from radixmesh.engine.scheduler.counters import SchedulerCounters
from radixmesh.engine.scheduler.hooks import HookSet

logger = logging.getLogger(__name__)


class DecodeManager:
    """Owns the running requests and the new-token ratio; builds the decode batches.

    `requeue` sends a retracted request back to the waiting queue; `finish` ends a request that cannot go on.
    """

    def __init__(self, config: EngineConfig, kv: KVCacheManager, counters: SchedulerCounters, hooks: HookSet,
                 context_len: int, requeue: Callable[[Req], None],
                 finish: Callable[[Req, FinishReason], None]) -> None:
        self.config = config
        self.kv = kv
        self.counters = counters
        self.hooks = hooks
        self.context_len = context_len
        self.requeue = requeue
        self.finish = finish
        self.running: list[Req] = []
        """Requests past their prefill, in admission order."""
        self.ratio_decay = ((config.init_new_token_ratio - config.min_new_token_ratio)
                            / config.new_token_ratio_decay_steps)
        self.new_token_ratio = config.init_new_token_ratio

    def reset_ratio(self) -> None:
        """The admission ratio at its start value (at construction, and after the warm-up)."""
        self.new_token_ratio = self.config.init_new_token_ratio

    def need(self, req: Req) -> int:
        """KV slots `req` is expected to decode into: the ratio of its remaining tokens."""
        return math.ceil(self.new_token_ratio * req.remaining_new_tokens)

    def reserved_tokens(self) -> int:
        """KV slots the running requests are expected to decode into."""
        return sum(self.need(r) for r in self.running)

    def take(self, rid: str) -> list[Req]:
        """Remove and return the running requests of `rid`."""
        taken = [r for r in self.running if r.rid == rid]
        for req in taken:
            self.running.remove(req)
        return taken

    def schedule(self) -> ScheduleBatch | None:
        """The next decode batch (retracting requests first if KV is short), or None."""
        self.retract_until_fits()
        if not self.running:
            return None
        # Under overlap, requests whose in-flight token is certainly their last sit this step out.
        reqs = [r for r in self.running if r.remaining_new_tokens > 0
                and len(r.origin_input_ids) + r.num_output_tokens < self.context_len]
        if not reqs:
            return None
        self.new_token_ratio = max(self.config.min_new_token_ratio, self.new_token_ratio - self.ratio_decay)
        batch = self.hooks.decode_batch(reqs)
        if batch is None:
            batch = build_decode_batch(reqs, self.kv)
        assert batch is not None, "decode slots were checked before allocation"
        return batch

    def retract_until_fits(self) -> None:
        """Send requests back to the queue (KV cached, evictable) until every survivor gets a slot."""
        retracted = False
        while (rank := self.kv.short_rank(self.running)) is not None:
            group = [r for r in self.running if self.kv.rank_of(r) == rank]  # the requests of the pool short of KV
            if len(group) == 1:
                req = group[0]
                self.running.remove(req)
                logger.warning("request %s stopped early: the KV cache cannot hold it", req.rid)
                self.finish(req, FinishReason.LENGTH)
                continue
            # Retract the request with the least output (and then the longest prompt): least lost work.
            victim = min(group, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
            self.running.remove(victim)
            victim.futures.clear()  # its in-flight token is dropped and sampled again on re-admission
            self.kv.release(victim)
            victim.num_retractions += 1
            self.counters.num_retractions += 1
            self.requeue(victim)
            retracted = True
        if retracted:
            self.new_token_ratio = min(1.0, max(self.config.init_new_token_ratio, 1.5 * self.new_token_ratio))
            logger.info("retracted requests; new_token_ratio=%.2f", self.new_token_ratio)
