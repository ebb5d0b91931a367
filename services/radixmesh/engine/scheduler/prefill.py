"""Prefill admission: the waiting queue, the prompt being prefilled in chunks, and who joins the next pass.

Each step `schedule` packs a prefill pass (policy.py): the chunked prompt first, then waiting requests in the
policy's order under the token, row and KV budgets. Hooks may leave waiting requests out of admission (the host
tier, while their prefix is loading).
"""

from __future__ import annotations

import time

from radixmesh.engine.batch import ScheduleBatch, build_extend_batch
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.kv_manager import KVCacheManager
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.counters import SchedulerCounters
from radixmesh.engine.scheduler.hooks import HookSet
from radixmesh.engine.scheduler.policy import PrefillAdder, order_waiting


class PrefillManager:
    """Owns the waiting queue and the chunked prefill; builds the prefill passes."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, counters: SchedulerCounters,
                 hooks: HookSet) -> None:
        self.config = config
        self.kv = kv
        self.counters = counters
        self.hooks = hooks
        self.waiting: list[Req] = []
        """Requests waiting for admission, oldest first (retracted and re-queued ones at the front)."""
        self.chunked_req: Req | None = None
        """The request whose prompt is being prefilled in chunks (its prefix locked), between its passes."""

    @property
    def has_work(self) -> bool:
        """A request waits for admission, or a prompt is half prefilled."""
        return bool(self.waiting) or self.chunked_req is not None

    def enqueue(self, req: Req) -> None:
        """A new request joins the back of the queue."""
        self.waiting.append(req)

    def requeue(self, req: Req) -> None:
        """A request that ran (retracted, or jumped forward) goes back to the front of the queue."""
        self.waiting.insert(0, req)

    def take_waiting(self, rid: str) -> list[Req]:
        """Remove and return the waiting requests of `rid`."""
        taken = [r for r in self.waiting if r.rid == rid]
        for req in taken:
            self.waiting.remove(req)
        return taken

    def take_chunked(self, rid: str) -> list[Req]:
        """Remove and return the chunked prefill if it is `rid`'s."""
        if self.chunked_req is None or self.chunked_req.rid != rid:
            return []
        req, self.chunked_req = self.chunked_req, None
        return [req]

    def schedule(self, running: list[Req], ratio: float) -> ScheduleBatch | None:
        """The next prefill pass, or None when nobody can be admitted; `running` requests keep their decode
        reserve of `ratio` times their remaining tokens."""
        if not self.waiting and self.chunked_req is None:
            return None
        adder = PrefillAdder(self.config, self.kv, running, ratio)
        if self.chunked_req is not None:
            adder.add_chunked(self.chunked_req)
        waiting = self.hooks.admissible(self.waiting)
        adder.add_waiting(order_waiting(waiting, self.config, self.kv, self.chunked_req))
        if not adder.can_run:
            return None
        admitted = {id(r) for r in adder.can_run}
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        self.chunked_req = None
        for req in adder.can_run:
            if req.num_retractions == 0 and req.num_jumps == 0 and req.kv_len == 0:
                self._count_first_admission(req)
        batch = build_extend_batch(adder.can_run, self.kv)
        assert batch is not None, "admission budget allowed a prefill that memory could not hold"
        return batch

    def _count_first_admission(self, req: Req) -> None:
        req.admitted_at = time.time()
        req.cached_tokens = min(len(req.prefix_indices), len(req.origin_input_ids))  # (a resumed output)
        self.counters.num_cached_tokens += req.cached_tokens
        self.counters.num_prompt_tokens += len(req.origin_input_ids)
