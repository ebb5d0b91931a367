"""The scheduler: continuous batching with chunked prefill, prefix reuse and retraction.

`step()` is the whole core loop: pick a batch, run it, process its output.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.batch import ScheduleBatch, build_decode_batch, build_extend_batch, commit_batch
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.grammar.manager import GrammarManager
from radixmesh.engine.grammar.vocab_mask import VocabMask
from radixmesh.engine.hicache.factory import build_controller, build_tree
from radixmesh.engine.kv_manager import KVCacheManager
from radixmesh.engine.launch_pacing import LaunchPacer
from radixmesh.engine.messages import TokenOut
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.engine.request import FinishReason, Req
from radixmesh.engine.sampling.sampler import HostSample, SampleOutput
from radixmesh.engine.schedule_policy import PrefillAdder, order_waiting
from radixmesh.engine.speculative.decoder import SpecDecoder
from radixmesh.engine.speculative.verify_batch import VerifyBatch
from radixmesh.engine.stop import check_finished

logger = logging.getLogger(__name__)
GRAMMAR_IDLE_WAIT_S = 0.01
"""With nothing to run but grammars compiling, how long one step waits for a compilation."""


@dataclass
class LaunchedBatch:
    """A batch whose forward and sampling are enqueued; its tokens are read back later."""

    launch_id: int
    batch: ScheduleBatch
    sampled: SampleOutput


class Scheduler:
    """Runs requests to completion on one model replica; outputs go to `emit`."""

    # set by reset_counters
    new_token_ratio: float
    num_retractions: int
    num_generated_tokens: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_forward_passes: int
    result_wait_s: float

    def __init__(self, config: EngineConfig, runner: ModelRunner, tokenizer: object,
                 emit: Callable[[list[TokenOut]], None]) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.emit = emit
        tree = build_tree(config, runner.allocator, runner.kv_pool)
        self.kv = KVCacheManager(runner.req_pool, runner.kv_pool, runner.allocator, tree)
        self.hicache = build_controller(config, self.kv)
        """The host tier's loads and holds (--enable-hierarchical-cache); None without it."""
        self.context_len = runner.context_len
        self.eos_ids = set(runner.model_config.eos_token_ids)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.in_flight: LaunchedBatch | None = None
        self.launch_id = 0
        self._ratio_decay = ((config.init_new_token_ratio - config.min_new_token_ratio)
                             / config.new_token_ratio_decay_steps)
        self.reset_counters()
        self.grammar = GrammarManager(config, tokenizer, runner.model_config.vocab_size,
                                      runner.model_config.eos_token_ids, self.context_len)
        self.grammar.warm_up(runner.device)
        self.spec = SpecDecoder.create(self) if config.speculative_algorithm else None
        self.pacer = LaunchPacer.create(config, runner.device)
        """Overlap on CUDA: how long the loop may hold a decode launch for an arriving request (launch_pacing.py)."""
        self._step_start = 0.0

    # ---- the core loop ----------------------------------------------------------------------
    def step(self) -> bool:
        """Launch one batch and process the previous one; False when there was nothing to do.

        With overlap on, batch N+1 is scheduled and launched before batch N's tokens are read
        back, so the host never waits on the device with nothing queued behind.
        """
        if self.pacer is not None:
            self._step_start = time.perf_counter()
        self._admit_compiled_grammars()
        if self.hicache is not None:
            self.hicache.tick(self.waiting, self.running, self.new_token_ratio)
        if self.in_flight is not None and self._needs_host_tokens():
            self.process_batch_result(self._take_in_flight())
        batch = self.get_next_batch()
        launched = self.launch(batch) if batch is not None else None
        previous, self.in_flight = self.in_flight, launched
        if previous is not None:
            self.process_batch_result(previous)
        if not self.config.overlap_enabled and self.in_flight is not None:
            self.process_batch_result(self._take_in_flight())
        if batch is None and previous is None and self.grammar.has_compiling:
            self.grammar.wait(GRAMMAR_IDLE_WAIT_S)
            return True
        if batch is None and previous is None and self.hicache is not None and self.hicache.loading:
            self.hicache.wait(GRAMMAR_IDLE_WAIT_S)  # only loads are pending: wait for one here
            return True
        return batch is not None or previous is not None

    def launch_deadline(self) -> float | None:
        """Until when (`time.perf_counter()`) the loop may hold the next step, listening for requests: only while
        a decode step is on the device and nobody waits for admission (launch_pacing.py). None: step now."""
        if (self.pacer is None or self.waiting or self.chunked_req is not None or self.in_flight is None
                or not self.in_flight.batch.is_decode or self.spec is not None):
            return None
        deadline = self.pacer.deadline()
        # (the scan of the running requests only where there is a hold to refuse)
        return None if deadline is None or self._needs_host_tokens() else deadline

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req or self.in_flight
                    or self.grammar.has_compiling or (self.hicache is not None and self.hicache.busy))

    # ---- intake -----------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        prompt_len = len(req.origin_input_ids)
        if prompt_len == 0:
            self._fail(req, "the prompt is empty")
        elif prompt_len >= self.context_len:
            self._fail(req, f"the prompt has {prompt_len} tokens; the context length is {self.context_len}")
        elif prompt_len + 1 > self.kv.capacity:
            self._fail(req, f"the prompt has {prompt_len} tokens; the KV cache holds {self.kv.capacity}")
        elif req.params.has_grammar:
            try:
                self.grammar.submit(req)  # it joins the queue once its grammar is compiled
            except RadixMeshError as exc:
                self._fail(req, exc.message)
        else:
            self.waiting.append(req)

    def _admit_compiled_grammars(self) -> None:
        ready, failed = self.grammar.collect()
        self.waiting.extend(ready)
        for req, message in failed:
            self._fail(req, message)

    def abort(self, rid: str) -> None:
        for queue in (self.waiting, self.running):
            for req in [r for r in queue if r.rid == rid]:
                queue.remove(req)
                self._finish(req, FinishReason.ABORT)
        if self.chunked_req is not None and self.chunked_req.rid == rid:
            req, self.chunked_req = self.chunked_req, None
            self._finish(req, FinishReason.ABORT)
        for req in self.grammar.remove(rid):
            self._finish(req, FinishReason.ABORT)

    def flush_cache(self) -> bool:
        if self.has_work:
            return False
        return self.kv.flush() and (self.spec is None or self.spec.flush())

    # ---- scheduling -------------------------------------------------------------------------
    def get_next_batch(self) -> ScheduleBatch | None:
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        if not self.running:
            return None
        return self._schedule_decode()

    def _schedule_prefill(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        adder = PrefillAdder(self.config, self.kv, self.running, self.new_token_ratio)
        if self.chunked_req is not None:
            adder.add_chunked(self.chunked_req)
        waiting = self.waiting if self.hicache is None else self.hicache.ready(self.waiting)
        adder.add_waiting(order_waiting(waiting, self.config, self.kv, self.chunked_req))
        if not adder.can_run:
            return None
        admitted = {id(r) for r in adder.can_run}
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        self.chunked_req = None
        for req in adder.can_run:
            if req.num_retractions == 0 and req.num_jumps == 0 and req.kv_len == 0:
                req.admitted_at = time.time()
                req.cached_tokens = len(req.prefix_indices)
                self.num_cached_tokens += req.cached_tokens
                self.num_prompt_tokens += len(req.origin_input_ids)
        batch = build_extend_batch(adder.can_run, self.kv)
        assert batch is not None, "admission budget allowed a prefill that memory could not hold"
        return batch

    def _schedule_decode(self) -> ScheduleBatch | None:
        self._retract_until_fits()
        if not self.running:
            return None
        # Under overlap, requests whose in-flight token is certainly their last sit this step out.
        reqs = [r for r in self.running if r.remaining_new_tokens > 0
                and len(r.origin_input_ids) + r.num_output_tokens < self.context_len]
        if not reqs:
            return None
        self.new_token_ratio = max(self.config.min_new_token_ratio, self.new_token_ratio - self._ratio_decay)
        batch = self.spec.build_batch(reqs) if self.spec is not None else build_decode_batch(reqs, self.kv)
        assert batch is not None, "decode slots were checked before allocation"
        return batch

    def _retract_until_fits(self) -> None:
        """Send requests back to the queue (KV cached, evictable) until every survivor gets a slot."""
        retracted = False
        while self.running and self.kv.available_tokens() < len(self.running):
            if len(self.running) == 1:
                req = self.running.pop()
                logger.warning("request %s stopped early: the KV cache cannot hold it", req.rid)
                self._finish(req, FinishReason.LENGTH)
                break
            # Retract the request with the least output (and then the longest prompt): least lost work.
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
            self.running.remove(victim)
            victim.futures.clear()  # its in-flight token is dropped and sampled again on re-admission
            self.kv.release(victim)
            victim.num_retractions += 1
            self.num_retractions += 1
            self.waiting.insert(0, victim)
            retracted = True
        if retracted:
            self.new_token_ratio = min(1.0, max(self.config.init_new_token_ratio, 1.5 * self.new_token_ratio))
            logger.info("retracted requests; new_token_ratio=%.2f", self.new_token_ratio)

    # ---- launch and results -----------------------------------------------------------------
    def launch(self, batch: ScheduleBatch) -> LaunchedBatch:
        """Enqueue the batch on the device and do all bookkeeping that needs no sampled token.

        Grammar masks are built while the forward pass runs, just before sampling is queued.
        """
        self.launch_id += 1
        self.num_forward_passes += 1
        launch_id = self.launch_id
        if isinstance(batch, VerifyBatch):
            assert self.spec is not None, "a verify batch without speculative decoding"
            return LaunchedBatch(launch_id, batch, self.spec.launch(batch, launch_id))

        def before_sample() -> VocabMask | None:
            self._commit_launch(batch, launch_id)
            return self._grammar_mask(batch, launch_id)

        sampled = self.runner.launch(batch, before_sample)
        if self.pacer is not None:
            self.pacer.launched(batch.is_decode, time.perf_counter() - self._step_start)
        return LaunchedBatch(launch_id, batch, sampled)

    def _commit_launch(self, batch: ScheduleBatch, launch_id: int) -> None:
        commit_batch(batch)
        for row, req in enumerate(batch.reqs):
            if req.is_chunked:
                self.kv.cache_unfinished(req)
                self.chunked_req = req
            elif req.prefill_only:
                self._finish(req, FinishReason.LENGTH)
            else:
                req.futures.append((launch_id, row))
                if not batch.is_decode:
                    if not self.kv.tree.disable:  # requests sharing the prompt reuse it from the next step
                        self.kv.cache_unfinished(req)  # (this KV's pass is queued before any pass reading it)
                    self.running.append(req)

    def _grammar_mask(self, batch: ScheduleBatch, launch_id: int) -> VocabMask | None:
        """Masks of the rows that sample under a grammar; None (no cost) when there are none."""
        rows = _grammar_rows(batch, launch_id)
        if not rows:
            return None
        if self.in_flight is not None and any(len(batch.reqs[row].futures) > 1 for row in rows):
            # Overlap: a matcher must accept the previous batch's token before it can mask this one.
            # This batch's forward pass is already queued, so the device keeps busy meanwhile.
            self.process_batch_result(self._take_in_flight())
            rows = _grammar_rows(batch, launch_id)
            if not rows:
                return None
        return self.grammar.build_mask(batch.reqs, rows, self.runner.device)

    def process_batch_result(self, launched: LaunchedBatch) -> None:
        """Append the batch's sampled tokens and finish requests that are done.

        Waits for this batch's results to reach the host, not for batches launched after it.
        """
        host = self._wait_for_results(launched.sampled)
        if self.pacer is not None:
            self.pacer.results_read(launched.batch.is_decode)
        if host.prompt_logprobs is not None:
            self._add_prompt_logprobs(launched.batch, host)
        outputs: list[TokenOut] = []
        for row, req in enumerate(launched.batch.reqs):
            if not req.futures or req.futures[0] != (launched.launch_id, row):
                continue  # chunk, prefill-only, or finished/retracted/aborted since launch
            req.futures.pop(0)
            for token_row in host.token_rows(row):  # several when drafts were verified
                self._append_token(req, host, token_row)
                if req.finished:
                    break
            if self.spec is not None:
                self.spec.settle(req, host, row)
            if not req.finished and self.grammar.may_jump(req):
                self._jump_forward(req)
            if req.finished:
                req.futures.clear()
                self.kv.release(req)
                self.running.remove(req)
            outputs.append(self._token_out(req))
        if outputs:
            self.emit(outputs)

    def _wait_for_results(self, sampled: SampleOutput) -> HostSample:
        start = time.perf_counter()
        host = sampled.to_host()
        self.result_wait_s += time.perf_counter() - start
        return host

    def _take_in_flight(self) -> LaunchedBatch:
        launched, self.in_flight = self.in_flight, None
        assert launched is not None
        return launched

    def _needs_host_tokens(self) -> bool:
        """Penalties need every generated token on the host before the next step is sampled;
        jump-forward needs it before the next step is scheduled (it may re-queue the request);
        so do drafts, and the step after a verification (its token counts decide the next batch)."""
        if self.spec is not None and self.in_flight is not None and self.spec.needs_host_tokens(
                self.in_flight.batch, len(self.running)):
            return True
        return any((r.params.has_penalties or self.grammar.may_jump(r)) and r.futures for r in self.running)

    def _append_token(self, req: Req, host: HostSample, row: int) -> None:
        token_id = host.token_ids[row]
        req.output_ids.append(token_id)
        req.pending_ids.append(token_id)
        self.num_generated_tokens += 1
        if req.wants_logprobs and host.logprobs is not None:
            req.pending_logprobs.append(host.logprobs[row])
            if req.params.top_logprobs and host.top_logprobs is not None:
                req.pending_top_logprobs.append(host.top_logprobs[row][: req.params.top_logprobs])
        reason, matched = check_finished(req, self.eos_ids, self.context_len, self.tokenizer)
        if reason is None and req.grammar is not None:
            reason, matched = self._grammar_verdict(req, token_id)
        if reason is not None:
            req.finish_reason, req.matched_stop = reason, matched

    def _grammar_verdict(self, req: Req, token_id: int) -> tuple[FinishReason | None, int | None]:
        """Advance the request's matcher; its grammar may end the request (a stop token accepted)."""
        if not self.grammar.accept(req, token_id):
            req.error = f"the grammar refused token {token_id} (internal error)"
            logger.error("request %s: %s", req.rid, req.error)
            return FinishReason.ERROR, None
        if req.grammar is not None and req.grammar.is_terminated():
            return FinishReason.STOP, token_id
        return None, None

    def _jump_forward(self, req: Req) -> None:
        """Append the text the grammar forces; the request re-queues to prefill it in one pass."""
        new_ids = self.grammar.jump_forward(req)
        if new_ids is None:
            return
        last = req.output_ids.pop()
        assert req.pending_ids and req.pending_ids[-1] == last, "the re-tokenized token was already sent"
        req.pending_ids.pop()
        req.output_ids += new_ids
        req.pending_ids += new_ids
        req.num_jumps += 1
        self.num_generated_tokens += len(new_ids) - 1
        reason, matched = check_finished(req, self.eos_ids, self.context_len, self.tokenizer)
        if reason is not None:  # a stop string inside the forced text
            req.finish_reason, req.matched_stop = reason, matched
            return
        # The KV of the unchanged prefix goes to the radix cache; re-admission matches it and
        # prefills the forced tokens.
        self.running.remove(req)
        self.kv.release(req)
        self.waiting.insert(0, req)

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

    def _token_out(self, req: Req) -> TokenOut:
        out = TokenOut(
            rid=req.rid, token_ids=req.pending_ids, prompt_tokens=len(req.origin_input_ids),
            cached_tokens=req.cached_tokens, completion_tokens=len(req.output_ids),
            logprobs=req.pending_logprobs if req.wants_logprobs else None,
            top_logprobs=req.pending_top_logprobs if req.params.top_logprobs else None,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            matched_stop=req.matched_stop, error=req.error,
            input_logprobs=req.pending_input_logprobs or None,
            input_top_logprobs=req.pending_input_top_logprobs if req.params.top_logprobs
            and req.pending_input_logprobs else None,
            admitted_at=req.admitted_at, host_load=req.host_load,
        )
        req.pending_ids, req.pending_logprobs, req.pending_top_logprobs = [], [], []
        req.pending_input_logprobs, req.pending_input_top_logprobs = [], []
        return out

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finish_reason = reason
        req.futures.clear()
        self.kv.release(req)
        self.emit([self._token_out(req)])

    def _fail(self, req: Req, message: str) -> None:
        req.error = message
        req.finish_reason = FinishReason.ERROR
        self.emit([self._token_out(req)])

    def reset_counters(self) -> None:
        """Counters and the admission ratio at their start values (at construction, and after the warm-up)."""
        self.num_retractions = self.num_generated_tokens = self.num_prompt_tokens = 0
        self.num_cached_tokens = self.num_forward_passes = 0
        self.result_wait_s = 0.0  # host time spent waiting for results to reach the host (one wait per step)
        self.new_token_ratio = self.config.init_new_token_ratio

    # ---- introspection ----------------------------------------------------------------------
    def stats(self) -> dict[str, object]:
        kv = self.kv
        return {
            "num_running_reqs": len(self.running) + (1 if self.chunked_req else 0),
            "num_waiting_reqs": len(self.waiting),
            "max_total_num_tokens": kv.capacity,
            "kv_used_tokens": kv.used_tokens(),
            "kv_free_tokens": kv.allocator.available_size(),
            "kv_cached_tokens": kv.tree.total_size(),
            "kv_usage": kv.used_tokens() / kv.capacity,
            "new_token_ratio": round(self.new_token_ratio, 4),
            "num_retractions": self.num_retractions,
            "num_generated_tokens": self.num_generated_tokens,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "num_forward_passes": self.num_forward_passes,
            **self.grammar.stats(),
            **(self.hicache.stats() if self.hicache is not None else {}),
            **(self.spec.stats() if self.spec is not None else {}),
            "cache_hit_rate": self.num_cached_tokens / max(self.num_prompt_tokens, 1),
            "context_len": self.context_len,
            "max_running_requests": self.runner.plan.max_running_requests,
            **self.runner.memory_info(),
        }


def _grammar_rows(batch: ScheduleBatch, launch_id: int) -> list[int]:
    """Rows of `batch` that sample a token under a grammar in launch `launch_id`."""
    return [row for row, req in enumerate(batch.reqs)
            if req.grammar is not None and req.futures and req.futures[-1] == (launch_id, row)]
