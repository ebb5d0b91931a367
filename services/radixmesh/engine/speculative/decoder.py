"""`SpecDecoder`: speculative decoding as a scheduler hook.

Per decode step the scheduler asks it for `decode_batch(reqs)` (a plain decode batch, or a `VerifyBatch`
with drafts), lets it `launch` a verify batch, and calls `settle(req, host, row)` for each request once its
tokens were appended; under the overlap scheduler, `needs_host_tokens` says when a step must wait for the
previous one's tokens (drafting needs them). Verify passes replay their own
CUDA graphs where captured (verify_graphs.py); decode steps without drafts keep theirs and overlap
(docs/speculative.md).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixmesh.engine.batch import LaunchedBatch, ScheduleBatch, build_decode_batch
from radixmesh.engine.device_io import tensor_to_device, to_device
from radixmesh.engine.grammar.vocab_mask import VocabMask
from radixmesh.engine.sampling.sampler import HostSample
from radixmesh.engine.scheduler.hooks import SchedulerHook
from radixmesh.engine.speculative.adaptive import AdaptivePolicy
from radixmesh.engine.speculative.base import BaseProposer, Proposal, ProposerContext
from radixmesh.engine.speculative.registry import create_proposer
from radixmesh.engine.speculative.tree import depths
from radixmesh.engine.speculative.verifier import Verifier, VerifyHostSample, VerifyOutput
from radixmesh.engine.speculative.verify_batch import VerifyBatch, build_verify_batch, settle_kv, settle_tree_kv
from radixmesh.engine.speculative.verify_graphs import make_verify_graphs

if TYPE_CHECKING:
    from radixmesh.engine.grammar.base import BaseGrammarBackend
    from radixmesh.engine.request import Req
    from radixmesh.engine.scheduler.core import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    """A request's verification in flight: KV `slots` reserved from position `start`, `num_drafts` drafts fed
    (`depth`: the longest chain of them, fewer than `num_drafts` in a draft tree)."""

    start: int
    num_drafts: int
    slots: torch.Tensor
    depth: int


@dataclass
class _LastStep:
    """The previous decode step, timed from its build to the next build."""

    started_s: float
    batch_size: int
    speculated: bool
    num_passes: int
    num_generated: int


class SpecDecoder(SchedulerHook):
    """Drafts, verifies and settles speculative tokens for the scheduler's decode steps."""

    def __init__(self, sched: Scheduler, proposer: BaseProposer) -> None:
        config = sched.config
        self.sched = sched
        self.proposer = proposer
        self.max_drafts = config.speculative_max_drafts
        trees = config.speculative_eagle_topk > 1
        self.verifier = Verifier(sched.runner, config.random_seed,
                                 make_verify_graphs(sched.runner, self.max_drafts, config.cuda_graph_max_bs),
                                 make_verify_graphs(sched.runner, self.max_drafts, config.cuda_graph_max_bs, tree=True)
                                 if trees else None)
        self.policy = AdaptivePolicy(self.max_drafts, proposer.relative_cost,
                                     enabled=not config.disable_speculative_backoff)
        self.pending: dict[str, _Pending] = {}
        self.active: dict[str, Req] = {}
        """Requests the proposer and the policy hold state for."""
        self._last: _LastStep | None = None
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_verified = 0
        """Request-steps that verified at least one draft."""
        self.num_verify_passes = 0
        self.num_overlapped_steps = 0
        """Plain decode steps built while the previous step ran (overlap scheduler)."""

    @classmethod
    def create(cls, sched: Scheduler) -> SpecDecoder:
        config = sched.config
        assert config.speculative_algorithm is not None, "SpecDecoder without --speculative-algorithm"
        proposer = create_proposer(config.speculative_algorithm, ProposerContext(config, sched.runner, sched.tokenizer))
        decoder = cls(sched, proposer)
        graphs = decoder.verifier.graphs
        logger.info("speculative decoding: %s, up to %d draft tokens, back-off %s; verify passes %s and wait for "
                    "the previous step's tokens; plain decode steps %s", config.speculative_algorithm,
                    config.speculative_max_drafts, "off" if config.disable_speculative_backoff else "on",
                    f"replay CUDA graphs (batch <= {graphs.max_bs}, else eager)" if graphs else "run eagerly",
                    "replay CUDA graphs and overlap" if sched.runner.graph_runner is not None else "as usual")
        return decoder

    # ---- the decode step --------------------------------------------------------------------
    def needs_host_tokens(self, in_flight: LaunchedBatch) -> bool:
        """Under the overlap scheduler: whether the launched batch's tokens must reach the host before the
        next batch is built: after a verification (its accepted counts place the next tokens), and
        whenever this batch size speculates (drafts continue the request's text)."""
        num_running = len(self.sched.running)
        return isinstance(in_flight.batch, VerifyBatch) or (num_running > 0 and self.policy.speculate(num_running))

    def decode_batch(self, reqs: list[Req]) -> ScheduleBatch | None:
        """This step's batch: drafts where they pay and fit, else a plain decode batch (always plain
        while some token is still on the device: the overlap scheduler runs ahead when drafts do not pay)."""
        self._observe_last_step()
        self._release_gone(reqs)
        batch: ScheduleBatch | None = None
        if any(r.futures for r in reqs):
            self.num_overlapped_steps += 1
        else:
            planned = self.policy.plan([r.rid for r in reqs])
            limits = [min(k, self._room(req)) for req, k in zip(reqs, planned)]
            if any(limits):
                batch = self._verify_batch(reqs, limits)
        if batch is None:
            batch = build_decode_batch(reqs, self.sched.kv)
        counters = self.sched.counters
        self._last = _LastStep(time.perf_counter(), len(reqs), isinstance(batch, VerifyBatch),
                               counters.num_forward_passes, counters.num_generated_tokens)
        return batch

    def _room(self, req: Req) -> int:
        """Most drafts the request can use: the tokens after them must fit max_new_tokens and the context.
        A prompt with images gets none: its image positions hold pad ids outside the vocabulary, which
        neither an n-gram lookup nor a draft model may read as tokens."""
        if req.mm is not None:
            return 0
        return max(0, min(req.remaining_new_tokens - 1, self.sched.context_len - req.fill_len - 1))

    def _verify_batch(self, reqs: list[Req], limits: list[int]) -> VerifyBatch | None:
        for req in reqs:
            self.active[req.rid] = req
        # drafts' values are read on the host only for sampled rows, grammars and penalties
        self.proposer.device_drafts_ok = all(
            r.params.is_greedy and r.grammar is None and not r.params.has_penalties for r in reqs)
        proposal = self.proposer.propose(reqs, limits)
        for req, drafts, limit in zip(reqs, proposal.drafts, limits):
            del drafts[limit:]
            if req.grammar is not None and drafts:
                del drafts[_grammar_prefix(req, drafts):]
        self._fit_memory(proposal)
        batch = build_verify_batch(reqs, proposal, self.sched.kv) if proposal.num_drafts else None
        if batch is None:  # nothing to verify: the drafts are dropped
            for req, drafts in zip(reqs, proposal.drafts):
                self.proposer.on_verified(req, 0)
                drafts.clear()
            return None
        for i, (req, drafts, row) in enumerate(zip(reqs, proposal.drafts, batch.row_starts)):
            slots = batch.out_cache_loc[row:row + len(drafts) + 1]
            depth = max(depths(batch.trees[i])) if batch.trees is not None else len(drafts)
            self.pending[req.rid] = _Pending(req.kv_len, len(drafts), slots, depth)
        return batch

    def _fit_memory(self, proposal: Proposal) -> None:
        """Shorten the longest draft lists until every request's tokens fit in free KV slots (a tree's last nodes
        go first: what is left is still a tree)."""
        available = self.sched.kv.available_tokens()
        need = sum(len(d) + 1 for d in proposal.drafts)
        while need > available:
            longest = max(proposal.drafts, key=len)
            if not longest:
                break
            longest.pop()
            need -= 1

    def launch(self, batch: ScheduleBatch, launch_id: int) -> VerifyOutput | None:
        """Enqueue a verify batch's pass and the acceptance (device work; results are read back later); other
        batches are the model runner's (None)."""
        if not isinstance(batch, VerifyBatch):
            return None
        for row, req in enumerate(batch.reqs):
            req.futures.append((launch_id, row))
        self.num_verify_passes += 1
        logits = self.verifier.forward(batch)
        info = self.verifier.sampling_info(batch)
        return self.verifier.verify(batch, logits, info, self._grammar_masks(batch))

    def settle(self, req: Req, host: HostSample, row: int) -> None:
        """After `req`'s tokens of this step were appended: keep the accepted drafts' KV, free the rest."""
        pending = self.pending.pop(req.rid, None)
        if pending is not None:
            assert isinstance(host, VerifyHostSample) and host.num_accepted is not None, "a verify row without results"
            accepted = host.num_accepted[row]
            if host.emit_rows is not None:  # a tree batch: the accepted path's rows, root first
                assert host.row_starts is not None
                first = host.row_starts[row]
                path = [host.emit_rows[first + d] - first for d in range(accepted + 1)]
                settle_tree_kv(req, pending.start, pending.num_drafts + 1, path, self.sched.kv)
            else:
                settle_kv(req, pending.start, pending.num_drafts + 1, accepted, self.sched.kv)
            self.proposer.on_verified(req, accepted)
            # (a tree's acceptance is counted along its depth: at most that many drafts can be accepted)
            self.policy.observe_request(req.rid, pending.depth, accepted)
            if pending.num_drafts:
                self.num_proposed += pending.num_drafts
                self.num_accepted += accepted
                self.num_verified += 1
        if req.finished:
            self._release(req)

    # ---- bookkeeping ------------------------------------------------------------------------
    def _observe_last_step(self) -> None:
        """Time the previous decode step (build to build) unless another pass ran in between."""
        last, self._last = self._last, None
        counters = self.sched.counters
        if last is None or counters.num_forward_passes != last.num_passes + 1:
            return
        self.policy.observe_step(last.batch_size, last.speculated, time.perf_counter() - last.started_s,
                                 counters.num_generated_tokens - last.num_generated)

    def _release_gone(self, reqs: list[Req]) -> None:
        running = {r.rid for r in reqs}
        for rid in [rid for rid in self.active if rid not in running]:
            self._release(self.active[rid])

    def _release(self, req: Req) -> None:
        pending = self.pending.pop(req.rid, None)
        if pending is not None:  # aborted while its verification ran (overlap): nothing settled its slots
            self.sched.kv.allocator.free(pending.slots)
            self.proposer.on_verified(req, 0)
        if self.active.pop(req.rid, None) is not None:
            self.proposer.release(req)
        self.policy.forget(req.rid)

    def _grammar_masks(self, batch: VerifyBatch) -> VocabMask | None:
        """Each grammar request's mask after each of its drafts (matchers advanced, then rolled back)."""
        if not any(req.grammar is not None for req in batch.reqs):
            return None
        backend = self._grammar_backend()
        device = self.sched.runner.device
        on_gpu = device.type == "cuda"
        mask = backend.allocate_mask(batch.num_rows, pinned=on_gpu)
        rows: list[int] = []
        for req, drafts, start in zip(batch.reqs, batch.drafts, batch.row_starts):
            matcher = req.grammar
            if matcher is None:
                continue
            advanced = 0
            for i in range(len(drafts) + 1):
                if matcher.is_terminated():  # a draft ended the grammar: the request stops there
                    break
                backend.fill_masks([matcher], mask, [start + i])
                rows.append(start + i)
                if i == len(drafts) or not matcher.accept_token(drafts[i]):
                    break
                advanced += 1
            if advanced:
                matcher.rollback(advanced)
        rows_device = to_device(rows, torch.int32, device) if on_gpu else None
        return VocabMask(tensor_to_device(mask, device), rows, rows_device)

    def _grammar_backend(self) -> BaseGrammarBackend:
        from radixmesh.engine.grammar.hook import GrammarHook

        grammar = self.sched.hooks.get(GrammarHook)
        assert grammar is not None, "a grammar request without the grammar hook"
        return grammar.manager.pool.backend

    def flush(self) -> bool:
        """Drop the proposer's caches; only called with no request left (the scheduler checks)."""
        for req in list(self.active.values()):
            self._release(req)
        return self.proposer.flush()

    def stats(self) -> dict[str, float | int]:
        verified = max(self.num_verified, 1)
        return {
            "spec_num_draft_tokens": self.num_proposed,
            "spec_num_accepted_tokens": self.num_accepted,
            "spec_num_verify_passes": self.num_verify_passes,
            "spec_num_verified_requests": self.num_verified,
            "spec_accept_rate": self.num_accepted / max(self.num_proposed, 1),
            "spec_accept_length": (self.num_accepted + self.num_verified) / verified if self.num_verified else 0.0,
            "spec_num_backoff_steps": self.policy.num_backoff_steps,
            "spec_num_overlapped_steps": self.num_overlapped_steps,
            **self.proposer.stats(),
        }


def _grammar_prefix(req: Req, drafts: list[int]) -> int:
    """How many leading drafts the request's grammar allows (the matcher ends where it started)."""
    matcher = req.grammar
    assert matcher is not None
    allowed = 0
    for token in drafts:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        allowed += 1
    if allowed:
        matcher.rollback(allowed)
    return allowed


def create_hook(sched: Scheduler) -> SpecDecoder | None:
    """With --speculative-algorithm; else None."""
    return SpecDecoder.create(sched) if sched.config.speculative_algorithm else None
