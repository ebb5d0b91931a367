"""Drafts from a small model with the target's tokenizer: its own runner, KV pool and radix cache.

Per step, one EXTEND pass brings each request's draft KV up to its last token (the tokens the
target accepted since, or a whole prompt the first time, within the prefill budget), then up to
`k - 1` DECODE passes extend the chains, each feeding the previous pass's tokens on the device
(greedy chains of one length: all in one draft-loop pass, one CUDA graph replay; else pass by pass,
replaying the draft's decode graphs); the drafts are read back once. Short catch-ups replay extend
graphs (`catch_up_graphs`). Each target request has a
shadow `Req` here sharing its token lists; draft KV past the shadow's `kv_len` is provisional
until `on_verified` keeps the accepted part.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from radixmesh.engine.attention.base import ForwardMode
from radixmesh.engine.batch import ScheduleBatch
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.device_io import to_device
from radixmesh.engine.kv_manager import KVCacheManager
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.request import Req
from radixmesh.engine.sampling.sampler import argmax
from radixmesh.engine.speculative.base import BaseProposer, Proposal, ProposerContext
from radixmesh.engine.speculative.draft_loop import DraftLoop, make_draft_loop
from radixmesh.engine.speculative.draft_setup import check_draft_fits, num_parameters, prepare_draft
from radixmesh.engine.speculative.eagle_setup import as_head
from radixmesh.engine.speculative.rejection import inverse_cdf
from radixmesh.engine.speculative.verify_graphs import VerifyGraphRunner, make_verify_graphs
from radixmesh.wire.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Shadow:
    """The draft side of one request: `req.kv_len` of its tokens have draft KV; positions up to
    `draft_end` hold this step's unverified drafts."""

    req: Req
    draft_end: int | None = None


@dataclass
class _Chain:
    """A request drafting this step."""

    index: int
    """Its place in the proposal."""
    shadow: _Shadow
    limit: int
    greedy: bool
    temperature: float


@dataclass
class _Passes:
    """The drafting passes of one step: per pass, the drafted tokens and which chains they extend."""

    tokens: list[torch.Tensor] = field(default_factory=list)
    """Per pass `[rows]` int64 on the device."""
    members: list[list[int]] = field(default_factory=list)
    """Per pass, the proposal index of each row."""
    probs: list[torch.Tensor] = field(default_factory=list)
    """Per pass `[rows, vocab]` the distributions drawn from (only when some request samples)."""


class DraftModelProposer(BaseProposer):
    id = "draft"
    graph_catch_up = True
    """Short catch-up passes replay extend graphs."""
    shares_prefixes = True
    """Finished requests' draft KV goes to a radix cache (an EAGLE head's KV also depends on the next token: no)."""

    def __init__(self, ctx: ProposerContext) -> None:
        config, target = ctx.config, ctx.target
        prepared = as_head(config, prepare_draft(config), target.context_len)
        check_draft_fits(target.model_config, target.context_len, ctx.tokenizer,
                         getattr(ctx.tokenizer, "name_or_path", None), prepared)
        draft_config = dataclasses.replace(
            config, model=config.speculative_draft_model, load_format=prepared.load_format, tokenizer=None,
            max_total_tokens=target.plan.max_total_tokens,
            max_running_requests=self._draft_rows(config, target.plan.max_running_requests),
            context_length=target.context_len, speculative_algorithm=None, speculative_draft_model=None,
            speculative_num_steps=None, speculative_eagle_topk=1)
        self.runner = ModelRunner(draft_config, prepared)
        self._setup_runner(ctx)
        tree = RadixCache(self.runner.allocator, disable=config.disable_radix_cache or not self.shares_prefixes)
        self.kv = KVCacheManager(self.runner.req_pool, self.runner.kv_pool, self.runner.allocator, tree)
        self.device = target.device
        self.prefill_budget = config.prefill_token_budget
        self.loop: DraftLoop | None = make_draft_loop(self.runner, self._loop_steps(config),
                                                      config.cuda_graph_max_bs, self._to_target, self._between_steps)
        """Greedy chains' decode steps in one pass (one CUDA graph replay), when the draft replays graphs."""
        self.catch_up_graphs: VerifyGraphRunner | None = (
            make_verify_graphs(self.runner, self._catch_up_graph_tokens(config) - 1, config.cuda_graph_max_bs)
            if self.graph_catch_up else None)
        """Catch-up passes of 1 or 2 tokens per request (after each verification: the token after the accepted
        drafts, and the last draft when all were accepted) through captured extend graphs of the verify kind."""
        self.shadows: dict[str, _Shadow] = {}
        self.relative_cost = num_parameters(prepared.config) / max(num_parameters(target.model_config), 1)
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(config.random_seed + 1)
        self.num_draft_passes = 0
        self.num_device_proposals = 0
        logger.info("draft model %s (%s weights, %.3fx the target's parameters)", prepared.name,
                    prepared.load_format, self.relative_cost)

    # ---- proposing --------------------------------------------------------------------------
    def propose(self, reqs: list[Req], max_drafts: list[int]) -> Proposal:
        drafts: list[list[int]] = [[] for _ in reqs]
        chains, logits = self._catch_up(reqs, max_drafts)
        if logits is None:
            return Proposal(drafts)
        passes = self._draft(chains, logits)
        tokens = torch.cat(passes.tokens)
        on_device = self.device_drafts_ok and not passes.probs
        # the one host read of this step's drafts, unless the verify pass takes them on the device
        flat = [0] * tokens.shape[0] if on_device else tokens.tolist()
        rows: dict[int, list[int]] = {c.index: [] for c in chains}  # proposal index -> flat rows, in order
        offset = 0
        for members in passes.members:
            for row, index in enumerate(members):
                rows[index].append(offset + row)
            offset += len(members)
        prob_rows = [0] * len(reqs)
        order: list[int] = []
        for chain in chains:
            drafts[chain.index] = [flat[r] for r in rows[chain.index]]
            prob_rows[chain.index] = len(order)
            order += rows[chain.index]
            chain.shadow.draft_end = chain.shadow.req.kv_len + len(rows[chain.index]) - 1
        draft_probs = None
        order_t = to_device(order, torch.int64, self.device)
        if passes.probs:
            draft_probs = torch.cat(passes.probs).index_select(0, order_t)
        if on_device:
            self.num_device_proposals += 1
            return Proposal(drafts, prob_rows=prob_rows, device_drafts=tokens.index_select(0, order_t))
        return Proposal(drafts, draft_probs, prob_rows)

    def _catch_up(self, reqs: list[Req], max_drafts: list[int]) -> tuple[list[_Chain], torch.Tensor | None]:
        """One EXTEND pass feeding each request the tokens the draft has no KV for, its last one
        included; those that caught up draft from their last row's logits (returned, `[chains, vocab]`)."""
        fed: list[tuple[int, _Shadow, int]] = []  # (proposal index, shadow, tokens fed)
        budget = self.prefill_budget
        for i, (req, limit) in enumerate(zip(reqs, max_drafts)):
            shadow = self._shadow(req) if limit > 0 and budget > 0 else None
            if shadow is None:
                continue
            feed = min(self._catch_up_len(req) - shadow.req.kv_len, budget)
            assert feed >= 1, f"request {req.rid}: the draft already has KV for its last token"
            budget -= feed
            fed.append((i, shadow, feed))
        slots = self.kv.alloc_slots(sum(n for _, _, n in fed)) if fed else None
        if slots is None:
            return [], None
        input_ids: list[int] = []
        positions: list[int] = []
        offset = 0
        for _, shadow, feed in fed:
            sreq = shadow.req
            start = sreq.kv_len
            input_ids += self._fed_tokens(sreq, start, feed)
            positions += range(start, start + feed)
            assert sreq.req_pool_idx is not None
            self.kv.req_pool.req_to_token[sreq.req_pool_idx, start:start + feed] = slots[offset:offset + feed]
            offset += feed
        shadows = [shadow.req for _, shadow, _ in fed]
        batch = ScheduleBatch(ForwardMode.EXTEND, shadows, input_ids, positions, slots,
                              [r.kv_len for r in shadows], [n for _, _, n in fed], _pool_rows(shadows))
        self._before_catch_up(reqs, [(i, shadow.req.kv_len, feed) for i, shadow, feed in fed])
        logits = self._catch_up_pass(batch)  # [len(fed), vocab]: each request's last fed token
        self.num_draft_passes += 1
        chains: list[_Chain] = []
        rows: list[int] = []
        for row, (i, shadow, feed) in enumerate(fed):
            shadow.req.kv_len += feed
            if shadow.req.kv_len == self._catch_up_len(reqs[i]):  # caught up (else: a long prompt, continued next step)
                params = reqs[i].params
                chains.append(_Chain(i, shadow, max_drafts[i], params.is_greedy, params.temperature))
                rows.append(row)
        if not chains:
            return [], None
        rows_t = to_device(rows, torch.int64, self.device)
        self._after_catch_up(rows_t, [n for _, _, n in fed])
        return chains, logits.index_select(0, rows_t)

    def _draft(self, chains: list[_Chain], logits: torch.Tensor) -> _Passes:
        """Draft token 1 from the catch-up logits, then one DECODE pass per further token."""
        sampled = any(not c.greedy for c in chains)
        looped = None if sampled else self._draft_loop(chains, logits)
        if looped is not None:
            return looped
        passes = _Passes()
        active = chains
        for step in range(1, max(c.limit for c in chains) + 1):
            if step > 1:
                keep = [row for row, c in enumerate(active) if c.limit >= step]
                active = [active[row] for row in keep]
                next_logits = self._decode(active, step, passes.tokens[-1], keep)
                if next_logits is None:  # no KV slot left for another pass: the chains end here
                    break
                logits = next_logits
            tokens, q = self._pick(logits, active, sampled)
            passes.tokens.append(tokens)
            passes.members.append([c.index for c in active])
            if q is not None:
                passes.probs.append(q)
        return passes

    def _catch_up_pass(self, batch: ScheduleBatch) -> torch.Tensor:
        """The catch-up pass's last-token logits: through a captured extend graph when one holds the batch (a few
        tokens per request, as after each verification), else eagerly (a prompt's first catch-up)."""
        graphs = self.catch_up_graphs
        key = graphs.key(batch) if graphs is not None else None
        if graphs is None or key is None:
            self._before_eager_catch_up()
            return self.runner.forward(batch)
        lasts = torch.cumsum(to_device(batch.extend_lens, torch.int64, self.device), 0) - 1
        return graphs.replay(batch, key, self._stage_catch_up).index_select(0, lasts)

    def _draft_loop(self, chains: list[_Chain], logits: torch.Tensor) -> _Passes | None:
        """Greedy chains of one length through the draft loop: every draft on the device, no host step between."""
        loop = self.loop
        limit = chains[0].limit
        starts = [c.shadow.req.kv_len for c in chains]
        if loop is None or limit < 2 or any(c.limit != limit for c in chains) or not loop.fits(
                len(chains), limit - 1, starts):
            return None
        slots = self.kv.alloc_slots(len(chains) * (limit - 1))
        if slots is None:
            return None
        first, _ = self._pick(logits, chains, False)
        self._before_loop(len(chains))
        out = loop.run(first, starts, _pool_rows([c.shadow.req for c in chains]), slots.view(limit - 1, len(chains)),
                       limit - 1)
        self.num_draft_passes += limit - 1
        members = [c.index for c in chains]
        return _Passes([first, *out.unbind(0)], [members] * limit)

    def _decode(self, active: list[_Chain], step: int, prev: torch.Tensor, keep: list[int]) -> torch.Tensor | None:
        """Feed each chain its draft `step - 1` (row `keep[i]` of `prev`, read on the device)."""
        slots = self.kv.alloc_slots(len(active))
        if slots is None:
            return None
        shadows = [c.shadow.req for c in active]
        positions = [r.kv_len + step - 2 for r in shadows]
        batch = ScheduleBatch(ForwardMode.DECODE, shadows, [0] * len(active), positions, slots, positions,
                              [1] * len(active), _pool_rows(shadows), future_rows=keep)
        self.runner.last_tokens = prev
        self.num_draft_passes += 1
        self._before_decode(keep)
        return self.runner.forward(batch)

    def _pick(self, logits: torch.Tensor, active: list[_Chain],
              sampled: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy chains take the argmax; the others draw from the temperature softmax `q` (returned)."""
        greedy_ids = argmax(logits)
        if not sampled:
            return self._to_target(greedy_ids), None
        temps = to_device([1.0 if c.greedy else c.temperature for c in active], torch.float32, self.device)
        q = torch.softmax(logits.float() / temps.unsqueeze(1), dim=-1)
        uniforms = torch.rand(len(active), generator=self._generator).to(self.device)
        is_greedy = to_device([c.greedy for c in active], torch.bool, self.device)
        ids = self._to_target(torch.where(is_greedy, greedy_ids, inverse_cdf(q, uniforms)))
        return ids, self._target_probs(q)

    # ---- what a draft head (EAGLE) changes ---------------------------------------------------
    def _setup_runner(self, ctx: ProposerContext) -> None:
        """Once the draft's runner is built, before its loop and catch-up graphs are captured."""

    def _catch_up_graph_tokens(self, config: EngineConfig) -> int:
        """Most tokens per request of a catch-up replayed from a graph: 2 after a verification."""
        return 2

    def _draft_rows(self, config: EngineConfig, num_requests: int) -> int:
        """Request rows of the draft's pool for `num_requests` target requests (shadows; an EAGLE tree's beams)."""
        return num_requests

    def _loop_steps(self, config: EngineConfig) -> int:
        """Decode steps of the captured draft loop (0: none)."""
        return config.speculative_max_drafts - 1

    def _before_eager_catch_up(self) -> None:
        """Before a catch-up pass runs eagerly."""

    def _stage_catch_up(self, graph_rows: list[int]) -> None:
        """Before a catch-up replays a graph: each fed token's row in the graph's layout."""

    def _catch_up_len(self, req: Req) -> int:
        """Positions of `req` whose draft KV the catch-up pass builds (all its tokens: a draft model)."""
        return req.fill_len

    def _fed_tokens(self, sreq: Req, start: int, feed: int) -> list[int]:
        """The tokens fed at positions `start .. start + feed - 1`."""
        return sreq.all_ids[start:start + feed]

    def _before_catch_up(self, reqs: list[Req], fed: list[tuple[int, int, int]]) -> None:
        """Before the catch-up pass: (proposal index, first position, tokens) of each fed request."""

    def _after_catch_up(self, rows: torch.Tensor, feeds: list[int]) -> None:
        """After it: `rows` of the fed requests (in its output) that draft on."""

    def _before_decode(self, keep: list[int]) -> None:
        """Before a decode pass extending the chains at rows `keep` of the previous pass."""

    def _before_loop(self, bs: int) -> None:
        """Before the draft loop of `bs` chains."""

    def _between_steps(self, bs: int) -> None:
        """Inside the draft loop, after each step (captured with it)."""

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of the draft's ids."""
        return ids

    def _target_probs(self, q: torch.Tensor) -> torch.Tensor:
        """Draft distributions over the target's vocabulary."""
        return q

    def _kept(self, req: Req, shadow: _Shadow, end: int, num_accepted: int) -> int:
        """Draft KV positions still valid after verification: its KV of the accepted drafts."""
        return min(end, shadow.req.kv_len + num_accepted, len(req.all_ids) - 1)

    # ---- per-request state ------------------------------------------------------------------
    def _shadow(self, req: Req) -> _Shadow | None:
        """The request's draft side, created on first use (its cached prefix matched and locked)."""
        shadow = self.shadows.get(req.rid)
        if shadow is not None:
            return shadow
        sreq = Req(rid=req.rid, origin_input_ids=req.origin_input_ids, params=SamplingParams())
        sreq.output_ids = req.output_ids  # the same list: the draft always sees the request's tokens
        self.kv.match(sreq)
        self.kv.lock(sreq)
        if not self.kv.assign_row(sreq):
            self.kv.unlock(sreq)
            return None
        shadow = self.shadows[req.rid] = _Shadow(sreq)
        return shadow

    def on_verified(self, req: Req, num_accepted: int) -> None:
        """Keep the draft KV of accepted drafts (never of the request's last token), free the rest."""
        shadow = self.shadows.get(req.rid)
        if shadow is None or shadow.draft_end is None:
            return
        sreq, end = shadow.req, shadow.draft_end
        shadow.draft_end = None
        # kv_len covers the verified token; drafts 1..num_accepted follow it, the last token has no KV
        valid = self._kept(req, shadow, end, num_accepted)
        assert sreq.req_pool_idx is not None
        row = self.kv.req_pool.req_to_token[sreq.req_pool_idx]
        if valid < end:
            self.kv.allocator.free(row[max(valid, sreq.kv_len):end].clone())
        if valid < sreq.kv_len:  # nothing was verified: the last token's KV goes too
            self.kv.allocator.free(row[valid:sreq.kv_len].clone())
        sreq.kv_len = valid

    def release(self, req: Req) -> None:
        shadow = self.shadows.pop(req.rid, None)
        if shadow is not None:
            assert shadow.draft_end is None, f"request {req.rid} released with unverified draft KV"
            self.kv.release(shadow.req)

    def flush(self) -> bool:
        return not self.shadows and self.kv.flush()

    def stats(self) -> dict[str, float | int]:
        kv = self.kv
        return {"spec_draft_passes": self.num_draft_passes, "spec_draft_device_proposals": self.num_device_proposals,
                "spec_draft_kv_used_tokens": kv.used_tokens(),
                "spec_draft_kv_cached_tokens": kv.tree.total_size()}


def _pool_rows(reqs: list[Req]) -> list[int]:
    rows = [r.req_pool_idx for r in reqs if r.req_pool_idx is not None]
    assert len(rows) == len(reqs), "a drafting request has no row in the draft's req_to_token"
    return rows
