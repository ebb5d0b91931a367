"""Result processing: a launched batch's tokens appended to its requests, finished requests released, and the
outputs (`TokenOut`) emitted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from radixmesh.engine.batch import LaunchedBatch, ScheduleBatch
from radixmesh.engine.kv_manager import KVCacheManager
from radixmesh.engine.request import FinishReason, Req
from radixmesh.engine.sampling.sampler import HostSample, SampleOutput
from radixmesh.engine.scheduler.counters import SchedulerCounters
from radixmesh.engine.scheduler.hooks import HookSet
from radixmesh.engine.stop import check_finished
from radixmesh.wire.messages import TokenOut

logger = logging.getLogger(__name__)


class ResultProcessor:
    """Turns sampled tokens into request state and outputs.

    `running` is the decode manager's list (finished requests leave it); `emit` sends outputs out of the
    scheduler; the stop rules read `eos_ids`, `context_len` and the `tokenizer` (stop strings).
    """

    def __init__(self, kv: KVCacheManager, counters: SchedulerCounters, hooks: HookSet, running: list[Req],
                 emit: Callable[[list[TokenOut]], None], eos_ids: set[int], context_len: int,
                 tokenizer: object) -> None:
        self.kv = kv
        self.counters = counters
        self.hooks = hooks
        self.running = running
        self.emit = emit
        self.eos_ids = eos_ids
        self.context_len = context_len
        self.tokenizer = tokenizer

    def process(self, launched: LaunchedBatch) -> None:
        """Append the batch's sampled tokens and finish requests that are done.

        Waits for this batch's results to reach the host, not for batches launched after it.
        """
        host = self._wait_for_results(launched.sampled)
        self.hooks.on_results(launched.batch)
        if host.prompt_logprobs is not None:
            self._add_prompt_logprobs(launched.batch, host)
        settle, after_tokens = self.hooks.overriding("settle"), self.hooks.overriding("after_tokens")
        outputs: list[TokenOut] = []
        for row, req in enumerate(launched.batch.reqs):
            if not req.futures or req.futures[0] != (launched.launch_id, row):
                continue  # chunk, prefill-only, or finished/retracted/aborted since launch
            req.futures.pop(0)
            for token_row in host.token_rows(row):  # several when drafts were verified
                self.append_token(req, host, token_row)
                if req.finished:
                    break
            for hook in settle:
                hook.settle(req, host, row)
            for hook in after_tokens:
                hook.after_tokens(req)
            if req.finished:
                req.futures.clear()
                self.kv.release(req)
                _remove_identical(self.running, req)
            outputs.append(self.token_out(req))
        if outputs:
            self.emit(outputs)

    def _wait_for_results(self, sampled: SampleOutput) -> HostSample:
        start = time.perf_counter()
        host = sampled.to_host()
        self.counters.result_wait_s += time.perf_counter() - start
        return host

    def append_token(self, req: Req, host: HostSample, row: int) -> None:
        """Append the token sampled at `row` (with its log-probs) and apply the stop rules and the hooks'."""
        token_id = host.token_ids[row]
        req.output_ids.append(token_id)
        req.pending_ids.append(token_id)
        self.counters.num_generated_tokens += 1
        if req.wants_logprobs and host.logprobs is not None:
            req.pending_logprobs.append(host.logprobs[row])
            if req.params.top_logprobs and host.top_logprobs is not None:
                req.pending_top_logprobs.append(host.top_logprobs[row][: req.params.top_logprobs])
        self._check_finished(req, token_id)

    def _check_finished(self, req: Req, token_id: int | None) -> None:
        reason, matched = check_finished(req, self.eos_ids, self.context_len, self.tokenizer)
        if reason is None and token_id is not None:
            for hook in self.hooks.overriding("token_verdict"):
                verdict = hook.token_verdict(req, token_id)
                if verdict is not None:
                    reason, matched = verdict
                    break
        if reason is not None:
            req.finish_reason, req.matched_stop = reason, matched

    def replace_last_token(self, req: Req, new_ids: list[int]) -> None:
        """Replace the request's last (not yet sent) token by `new_ids` and apply the stop rules (jump-forward:
        the forced text, re-tokenized with the token before it)."""
        last = req.output_ids.pop()
        assert req.pending_ids and req.pending_ids[-1] == last, "the re-tokenized token was already sent"
        req.pending_ids.pop()
        req.output_ids += new_ids
        req.pending_ids += new_ids
        self.counters.num_generated_tokens += len(new_ids) - 1
        self._check_finished(req, None)

    def start_decoding(self, req: Req, first_token: int, logprob: float | None,
                       top_logprobs: list[tuple[int, float]] | None) -> None:
        """A request whose prompt's KV is already in its row gets its first token from elsewhere (a prefill
        worker); it joins the running requests, or finishes at once."""
        req.kv_len = len(req.origin_input_ids)
        req.output_ids.append(first_token)
        req.pending_ids.append(first_token)
        if req.wants_logprobs and logprob is not None:
            req.pending_logprobs.append(logprob)
            if req.params.top_logprobs and top_logprobs is not None:
                req.pending_top_logprobs.append(top_logprobs)
        self.counters.num_prompt_tokens += len(req.origin_input_ids)
        self.counters.num_cached_tokens += req.cached_tokens
        self.counters.num_generated_tokens += 1
        reason, matched = check_finished(req, self.eos_ids, self.context_len, self.tokenizer)
        if reason is not None:
            req.finish_reason, req.matched_stop = reason, matched
            self.kv.release(req)  # the prompt's KV goes to the radix tree
        else:
            self.running.append(req)
        self.emit([self.token_out(req)])

    def _add_prompt_logprobs(self, batch: ScheduleBatch, host: HostSample) -> None:
        plan = batch.prompt_logprobs
        assert plan is not None, "prompt log-probs without a plan"
        values, tops = host.prompt_logprobs, host.prompt_top_logprobs
        assert values is not None
        offset = 0
        for req, count in zip(batch.reqs, plan.counts):
            req.pending_input_logprobs += values[offset:offset + count]
            if tops is not None and req.params.top_logprobs:
                req.pending_input_top_logprobs += [row[: req.params.top_logprobs]
                                                   for row in tops[offset:offset + count]]
            offset += count

    def token_out(self, req: Req) -> TokenOut:
        """The request's output since the last one (its pending tokens and log-probs, then cleared)."""
        out = TokenOut(
            rid=req.rid, token_ids=req.pending_ids, prompt_tokens=len(req.origin_input_ids),
            cached_tokens=req.cached_tokens, completion_tokens=len(req.output_ids),
            logprobs=req.pending_logprobs if req.wants_logprobs else None,
            top_logprobs=req.pending_top_logprobs if req.params.top_logprobs else None,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            matched_stop=req.matched_stop, error=req.error, error_code=req.error_code,
            input_logprobs=req.pending_input_logprobs or None,
            input_top_logprobs=req.pending_input_top_logprobs if req.params.top_logprobs
            and req.pending_input_logprobs else None,
            admitted_at=req.admitted_at, host_load=req.host_load,
        )
        req.pending_ids, req.pending_logprobs, req.pending_top_logprobs = [], [], []
        req.pending_input_logprobs, req.pending_input_top_logprobs = [], []
        return out

    def finish(self, req: Req, reason: FinishReason) -> None:
        """End a request that holds KV (aborted, or out of room) and emit its last output."""
        req.finish_reason = reason
        req.futures.clear()
        self.kv.release(req)
        self.emit([self.token_out(req)])

    def fail(self, req: Req, message: str, code: str = "invalid_argument") -> None:
        """End a request that holds no KV with an error (refused at intake; `code`: an `ErrorCode` value) and
        emit it."""
        req.error = message
        req.error_code = code
        req.finish_reason = FinishReason.ERROR
        self.emit([self.token_out(req)])


def _remove_identical(reqs: list[Req], req: Req) -> None:
    """`reqs.remove(req)` by identity. Req's dataclass `==` compares every field, so `list.remove` made each
    finished request cost a field-by-field comparison with every request before it: 3,000 requests of a tiny
    model finishing in one step spent 18 s there."""
    for i, other in enumerate(reqs):
        if other is req:
            del reqs[i]
            return
    raise ValueError(f"request {req.rid} is not running")
