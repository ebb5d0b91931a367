"""The scheduler: continuous batching with chunked prefill, prefix reuse and retraction, as a composer.

`step()` is the whole core loop: schedule a batch, launch it, process the previous one. Its parts live
beside it: prefill admission (prefill.py), decode (decode.py) and result processing (results.py); optional
features (grammar, host tier, speculation, launch pacing) plug in through hooks (hooks.py) and are never
named here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from radixmesh.engine.batch import LaunchedBatch, ScheduleBatch, commit_batch
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.grammar.vocab_mask import VocabMask
from radixmesh.engine.hicache.factory import build_tree
from radixmesh.engine.kv_manager import KVCacheManager
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.engine.request import FinishReason, Req
from radixmesh.engine.scheduler.counters import SchedulerCounters
from radixmesh.engine.scheduler.decode import DecodeManager
from radixmesh.engine.scheduler.hooks import HookSet
from radixmesh.engine.scheduler.prefill import PrefillManager
from radixmesh.engine.scheduler.results import ResultProcessor
from radixmesh.wire.messages import TokenOut

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.01
"""With nothing to launch or process but a hook's work pending (grammars compiling, host loads), how long one step
waits for it."""


class Scheduler:
    """Runs requests to completion on one model replica; outputs go to `emit`.

    Public surface for the scheduler loop, hooks and disaggregation: `step`, `add_request`, `abort`,
    `flush_cache`, `launch_deadline`, `stats`; `enqueue`, `requeue`, `fail` and `commit_prefilled` move
    requests between the parts; `process_in_flight` is the one place a launched batch is processed.
    """

    def __init__(self, config: EngineConfig, runner: ModelRunner, tokenizer: object,
                 emit: Callable[[list[TokenOut]], None]) -> None:
        if config.chunked_prefill_size is None:  # the runner sized it by the device's memory
            config = dataclasses.replace(config, chunked_prefill_size=runner.config.chunk_size)
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.emit = emit
        """Where outputs go; may be replaced (the warm-up mutes it, disaggregation filters it)."""
        self.kv = build_kv_manager(config, runner)
        self.context_len = runner.context_len
        self.eos_ids = set(runner.model_config.eos_token_ids)
        self.counters = SchedulerCounters()
        self.hooks = HookSet()
        self.prefill = PrefillManager(config, self.kv, self.counters, self.hooks)
        self.decode = DecodeManager(config, self.kv, self.counters, self.hooks, self.context_len,
                                    self.prefill.requeue, lambda req, reason: self.results.finish(req, reason))
        self.results = ResultProcessor(self.kv, self.counters, self.hooks, self.decode.running,
                                       lambda outs: self.emit(outs), self.eos_ids, self.context_len, tokenizer)
        self.in_flight: LaunchedBatch | None = None
        """The launched batch whose results are not processed yet (overlap: the one on the device)."""
        self.launch_id = 0
        for hook in HookSet.build(self):
            self.hooks.add(hook)

    # ---- the core loop ----------------------------------------------------------------------
    def step(self) -> bool:
        """Launch one batch and process the previous one; False when there was nothing to do. With overlap on, batch
        N+1 is launched before batch N's tokens are read back: the host never waits on an idle device."""
        self.hooks.on_step_start()
        if self.in_flight is not None and self.needs_host_tokens():
            self.process_in_flight()
        batch = self.schedule()
        processed = self.process_in_flight(then=self.launch(batch) if batch is not None else None)
        if not self.config.overlap_enabled:
            self.process_in_flight()
        if batch is None and not processed:
            return self.hooks.idle_wait(IDLE_WAIT_S)
        return True

    def schedule(self) -> ScheduleBatch | None:
        """The next batch: a prefill pass when anyone can be admitted, else a decode step (or None)."""
        batch = self.prefill.schedule(self.running, self.decode.new_token_ratio)
        if batch is not None or not self.running:
            return batch
        return self.decode.schedule()

    def launch(self, batch: ScheduleBatch) -> LaunchedBatch:
        """Enqueue the batch on the device and do all bookkeeping that needs no sampled token.

        Hooks' masks (grammars) are built while the forward pass runs, just before sampling is queued.
        """
        self.launch_id += 1
        self.counters.num_forward_passes += 1
        launch_id = self.launch_id
        with self.hooks.launch_scope(batch):
            sampled = self.hooks.launch(batch, launch_id)
            if sampled is not None:
                return LaunchedBatch(launch_id, batch, sampled)

            def before_sample() -> VocabMask | None:
                self._commit_launch(batch, launch_id)
                return self.hooks.vocab_mask(batch, launch_id)

            sampled = self.runner.launch(batch, before_sample)
            self.hooks.on_launched(batch)
        return LaunchedBatch(launch_id, batch, sampled)

    def process_in_flight(self, then: LaunchedBatch | None = None) -> bool:
        """Process the batch in flight, if any, and put `then` in flight; whether there was one."""
        launched, self.in_flight = self.in_flight, then
        if launched is None:
            return False
        self.results.process(launched)
        return True

    def _commit_launch(self, batch: ScheduleBatch, launch_id: int) -> None:
        commit_batch(batch)
        for row, req in enumerate(batch.reqs):
            if req.is_chunked:
                self.kv.cache_unfinished(req)
                self.prefill.chunked_req = req
            elif req.prefill_only:
                self.results.finish(req, FinishReason.LENGTH)
            else:
                req.futures.append((launch_id, row))
                if not batch.is_decode:
                    if not self.kv.tree.disable:  # requests sharing the prompt reuse it from the next step
                        self.kv.cache_unfinished(req)  # (this KV's pass is queued before any pass reading it)
                    self.running.append(req)

    def needs_host_tokens(self) -> bool:
        """Whether the batch in flight must be processed before the next is scheduled: penalties need every
        generated token on the host before the next step is sampled; hooks say when they do."""
        in_flight = self.in_flight
        if in_flight is not None and self.hooks.needs_host_tokens(in_flight):
            return True
        return any(r.params.has_penalties and r.futures for r in self.running)

    def launch_deadline(self) -> float | None:
        """Until when (`time.perf_counter()`) the loop may hold the next step, listening for requests: only
        while a decode step is on the device and nobody waits for admission, as a hook decides
        (scheduler/pacing.py). None: step now."""
        if self.prefill.has_work or self.in_flight is None or not self.in_flight.batch.is_decode:
            return None
        return self.hooks.launch_deadline()

    @property
    def running(self) -> list[Req]:
        """The running requests (the decode manager's)."""
        return self.decode.running

    @property
    def has_work(self) -> bool:
        return bool(self.prefill.has_work or self.running or self.in_flight or self.hooks.busy)

    # ---- intake -----------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a new request, or fail it at once when it cannot run here."""
        problem = self._refusal(req)
        if problem is not None:
            self.fail(req, problem)
        elif not self.hooks.take_request(req):
            self.prefill.enqueue(req)

    def _refusal(self, req: Req) -> str | None:
        prompt_len = len(req.origin_input_ids)
        if prompt_len == 0:
            return "the prompt is empty"
        if prompt_len >= self.context_len:
            return f"the prompt has {prompt_len} tokens; the context length is {self.context_len}"
        if prompt_len + 1 > self.kv.rank_capacity:
            return f"the prompt has {prompt_len} tokens; the KV cache holds {self.kv.rank_capacity}"
        return None

    def enqueue(self, req: Req) -> None:
        """A request a hook held (or a fallback) joins the waiting queue."""
        self.prefill.enqueue(req)

    def requeue(self, req: Req) -> None:
        """A running request goes back to the front of the queue; its KV goes to the radix cache, where
        re-admission matches it."""
        self.running.remove(req)
        self.kv.release(req)
        self.prefill.requeue(req)

    def fail(self, req: Req, message: str, code: str = "invalid_argument") -> None:
        """End a request that holds no KV with an error (`code`: an `ErrorCode` value)."""
        self.results.fail(req, message, code)

    def commit_prefilled(self, req: Req, cached_tokens: int, first_token: int, logprob: float | None = None,
                         top_logprobs: list[tuple[int, float]] | None = None) -> None:
        """A request whose prompt's KV was written into its row from elsewhere (a prefill worker) starts
        decoding from its first token; `cached_tokens` of its prompt came from a cache."""
        req.cached_tokens = cached_tokens
        self.results.start_decoding(req, first_token, logprob, top_logprobs)

    def abort(self, rid: str) -> None:
        """End request `rid` wherever it is: queued, running, half prefilled, or held by a hook."""
        for req in [*self.prefill.take_waiting(rid), *self.decode.take(rid), *self.prefill.take_chunked(rid)]:
            self.results.finish(req, FinishReason.ABORT)
        for req in self.hooks.remove(rid):
            self.results.finish(req, FinishReason.ABORT)

    def flush_cache(self) -> bool:
        if self.has_work:
            return False
        return self.kv.flush() and self.hooks.flush()

    def reset_counters(self) -> None:
        """Counters and the admission ratio at their start values (after the warm-up)."""
        self.counters.reset()
        self.decode.reset_ratio()

    # ---- introspection ----------------------------------------------------------------------
    def stats(self) -> dict[str, object]:
        kv, counters = self.kv, self.counters
        return {
            "num_running_reqs": len(self.running) + (1 if self.prefill.chunked_req else 0),
            "num_waiting_reqs": len(self.prefill.waiting),
            "max_total_num_tokens": kv.capacity,
            "kv_used_tokens": kv.used_tokens(),
            "kv_free_tokens": kv.allocator.available_size(),
            "kv_cached_tokens": kv.tree.total_size(),
            "kv_usage": kv.used_tokens() / kv.capacity,
            "new_token_ratio": round(self.decode.new_token_ratio, 4),
            "num_retractions": counters.num_retractions,
            "num_generated_tokens": counters.num_generated_tokens,
            "num_prompt_tokens": counters.num_prompt_tokens,
            "num_cached_tokens": counters.num_cached_tokens,
            "num_forward_passes": counters.num_forward_passes,
            **self.hooks.stats(),
            **kv.extra_stats(),
            "cache_hit_rate": counters.num_cached_tokens / max(counters.num_prompt_tokens, 1),
            "context_len": self.context_len,
            "max_running_requests": self.runner.plan.max_running_requests,
            "chunked_prefill_size": self.config.chunk_size,
            **self.runner.memory_info(),
        }


def build_kv_manager(config: EngineConfig, runner: ModelRunner) -> KVCacheManager:
    """The KV manager over the runner's pools: one pool, or one per rank under data-parallel attention."""
    if config.enable_dp_attention:
        from radixmesh.engine.dp_kv import DpKVCacheManager

        return DpKVCacheManager.over(runner.req_pool, runner.kv_pool, runner.allocator, config.disable_radix_cache)
    return KVCacheManager(runner.req_pool, runner.kv_pool, runner.allocator,
                          build_tree(config, runner.allocator, runner.kv_pool))
