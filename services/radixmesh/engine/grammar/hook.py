"""Structured outputs in the scheduler: a grammar request waits for its grammar, samples under its mask,
feeds every token to its matcher, and may jump forward over text the grammar forces.

The scheduler knows none of this; `GrammarHook` plugs in at the points of `SchedulerHook`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.grammar.manager import GrammarManager
from radixmesh.engine.request import FinishReason, Req
from radixmesh.engine.scheduler.hooks import SchedulerHook, Verdict

if TYPE_CHECKING:
    from radixmesh.engine.batch import LaunchedBatch, ScheduleBatch
    from radixmesh.engine.grammar.vocab_mask import VocabMask
    from radixmesh.engine.scheduler.core import Scheduler

logger = logging.getLogger(__name__)


class GrammarHook(SchedulerHook):
    """Holds grammar requests until compiled, masks their sampling, checks their tokens, jumps forward."""

    def __init__(self, sched: Scheduler, manager: GrammarManager) -> None:
        self.sched = sched
        self.manager = manager

    # ---- intake -----------------------------------------------------------------------------------
    def take_request(self, req: Req) -> bool:
        if not req.params.has_grammar:
            return False
        try:
            self.manager.submit(req)  # it joins the queue once its grammar is compiled
        except RadixMeshError as exc:
            self.sched.fail(req, exc.message)
        return True

    def remove(self, rid: str) -> list[Req]:
        return self.manager.remove(rid)

    def on_step_start(self) -> None:
        ready, failed = self.manager.collect()
        for req in ready:
            self.sched.enqueue(req)
        for req, message in failed:
            self.sched.fail(req, message)

    @property
    def busy(self) -> bool:
        return self.manager.has_compiling

    def idle_wait(self, timeout_s: float) -> bool:
        if not self.manager.has_compiling:
            return False
        self.manager.wait(timeout_s)
        return True

    # ---- sampling under a grammar -----------------------------------------------------------------
    def needs_host_tokens(self, in_flight: LaunchedBatch) -> bool:
        """Jump-forward needs a request's token on the host before the next step is scheduled (it may re-queue
        the request)."""
        if not self.manager.jump_forward_enabled:
            return False
        return any(self.manager.may_jump(r) and r.futures for r in self.sched.running)

    def vocab_mask(self, batch: ScheduleBatch, launch_id: int) -> VocabMask | None:
        """Masks of the rows that sample under a grammar; None (no cost) when there are none."""
        rows = grammar_rows(batch, launch_id)
        if not rows:
            return None
        if self.sched.in_flight is not None and any(len(batch.reqs[row].futures) > 1 for row in rows):
            # Overlap: a matcher must accept the previous batch's token before it can mask this one.
            # This batch's forward pass is already queued, so the device keeps busy meanwhile.
            self.sched.process_in_flight()
            rows = grammar_rows(batch, launch_id)
            if not rows:
                return None
        return self.manager.build_mask(batch.reqs, rows, self.sched.runner.device)

    def token_verdict(self, req: Req, token_id: int) -> Verdict | None:
        """Advance the request's matcher; its grammar may end the request (a stop token accepted)."""
        if req.grammar is None:
            return None
        if not self.manager.accept(req, token_id):
            req.error = f"the grammar refused token {token_id} (internal error)"
            logger.error("request %s: %s", req.rid, req.error)
            return FinishReason.ERROR, None
        if req.grammar is not None and req.grammar.is_terminated():
            return FinishReason.STOP, token_id
        return None

    def after_tokens(self, req: Req) -> None:
        """Append the text the grammar forces; the request re-queues to prefill it in one pass."""
        if req.finished or not self.manager.may_jump(req):
            return
        new_ids = self.manager.jump_forward(req)
        if new_ids is None:
            return
        req.num_jumps += 1
        self.sched.results.replace_last_token(req, new_ids)
        if req.finished:  # a stop string inside the forced text
            return
        # The KV of the unchanged prefix goes to the radix cache; re-admission matches it and
        # prefills the forced tokens.
        self.sched.requeue(req)

    def stats(self) -> dict[str, float]:
        return self.manager.stats()


def grammar_rows(batch: ScheduleBatch, launch_id: int) -> list[int]:
    """Rows of `batch` that sample a token under a grammar in launch `launch_id`."""
    return [row for row, req in enumerate(batch.reqs)
            if req.grammar is not None and req.futures and req.futures[-1] == (launch_id, row)]


def create_hook(sched: Scheduler) -> GrammarHook:
    """Always on: any request may bring a grammar."""
    mc = sched.runner.model_config
    manager = GrammarManager(sched.config, sched.tokenizer, mc.vocab_size, mc.eos_token_ids, sched.context_len)
    manager.warm_up(sched.runner.device)
    return GrammarHook(sched, manager)
