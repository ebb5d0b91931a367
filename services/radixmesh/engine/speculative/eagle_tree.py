"""EAGLE draft trees (`--speculative-eagle-topk K > 1`), drafted as SGLang does.

After the head's catch-up pass, the top-K tokens of its last row are the tree's first level (K beams). Each further
step (`--speculative-num-steps` S in all) runs one head DECODE pass over the K beams of every request, each beam in a
request row of its own holding the request's head KV and its ancestors' (so plain decode attention sees exactly its
path), takes the top-K children of every beam (K * K candidates, scored by cumulative log-probability) and keeps the K
best as the next beams. Of all candidates (K + (S - 1) * K * K), the N - 1 best by score form the tree
(`--speculative-num-draft-tokens` N counts the root): a child never scores above its parent and comes after it, so a
stable sort keeps every kept node's ancestors. Everything stays on the device until the tree is read back once; the
beams' head KV is freed at once (after verification a head keeps only its catch-up KV). Where the head replays CUDA
graphs, steps 2..S run as one captured pass (tree_loop.py); otherwise pass by pass (each pass replaying the head's
decode graphs where they hold it).

Only greedy requests without a grammar or penalties draft trees (their verification is exact argmax matching along
the tree); the others decode without drafts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixmesh.engine.attention.base import ForwardMode
from radixmesh.engine.batch import ScheduleBatch
from radixmesh.engine.device_io import to_device
from radixmesh.engine.request import Req
from radixmesh.engine.speculative.base import Proposal

if TYPE_CHECKING:
    from radixmesh.engine.speculative.draft_model import _Chain
    from radixmesh.engine.speculative.eagle import EagleProposer
    from radixmesh.engine.speculative.tree_loop import TreeLoop


def may_draft_tree(req: Req) -> bool:
    """Whether a request's verification along a tree is exact: greedy, no grammar, no penalties."""
    return req.params.is_greedy and req.grammar is None and not req.params.has_penalties


@dataclass
class _Candidates:
    """Every scored candidate node so far, per request `[chains, T]`: score, target token, parent candidate (-1)."""

    scores: list[torch.Tensor]
    tokens: list[torch.Tensor]
    parents: list[torch.Tensor]

    @property
    def count(self) -> int:
        return sum(s.shape[1] for s in self.scores)


@dataclass
class _Beams:
    """The K best open nodes of each request, `[chains, K]`, and their input features `[chains * K, hidden]`."""

    scores: torch.Tensor
    tokens: torch.Tensor
    cand: torch.Tensor
    features: torch.Tensor


@dataclass
class Grown:
    """One tree step's result, per request: its `K * K` scored children and the K best of them as the next beams."""

    scores: torch.Tensor
    """[chains, K * K] cumulative log-probabilities; child j of beam b at column `b * K + j`."""
    tokens: torch.Tensor
    """[chains, K * K] target ids."""
    parents: torch.Tensor
    """[chains, K * K] the candidate index of each child's parent beam."""
    best_scores: torch.Tensor
    """[chains, K] the next beams'."""
    best_tokens: torch.Tensor
    best_cand: torch.Tensor
    """[chains, K] their candidate indices (from `offset`)."""
    parent_beams: torch.Tensor
    """[chains * K] each next beam's parent, as a flat beam index."""


def expand_beams(logits: torch.Tensor, beam_scores: torch.Tensor, beam_cand: torch.Tensor, k: int,
                 to_target: Callable[[torch.Tensor], torch.Tensor], offset: int) -> Grown:
    """The top-K children of each beam (`logits` `[chains * K, draft vocab]`, the beams' head outputs) scored by
    cumulative log-probability, and the K best children of each request; `offset`: candidates before these."""
    num_chains = beam_scores.shape[0]
    child_logp, child_ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [chains * K, K]
    scores = (beam_scores.reshape(-1, 1) + child_logp).reshape(num_chains, k * k)
    tokens = to_target(child_ids).reshape(num_chains, k * k)
    best_scores, best = scores.topk(k, dim=-1)  # [chains, K]
    parent = (torch.arange(num_chains, device=best.device) * k).unsqueeze(1) + best // k
    return Grown(scores, tokens, beam_cand.repeat_interleave(k, dim=1), best_scores, tokens.gather(1, best),
                 offset + best, parent.reshape(-1))


def copy_paths(req_to_token: torch.Tensor, rows: torch.Tensor, parent_beams: torch.Tensor, starts: torch.Tensor,
               step: int) -> None:
    """Each new beam's row takes its parent beam's path: the `step` slots from its start position."""
    cols = starts.unsqueeze(1) + torch.arange(step, device=starts.device)  # [beams, step]
    req_to_token[rows.unsqueeze(1), cols] = req_to_token[rows.index_select(0, parent_beams).unsqueeze(1), cols]


class TreeDrafter:
    """Drafts trees of `steps` levels, `topk` branches, up to `max_nodes` nodes for an `EagleProposer`."""

    def __init__(self, proposer: EagleProposer, topk: int, steps: int, max_nodes: int) -> None:
        self.proposer = proposer
        self.topk = topk
        self.steps = steps
        self.max_nodes = max_nodes
        self.num_trees = 0
        self.loop: TreeLoop | None = None
        """Steps 2..S in one pass (one CUDA graph replay) when the head replays graphs (tree_loop.py)."""

    def propose(self, reqs: list[Req], max_drafts: list[int]) -> Proposal:
        p = self.proposer
        limits = [limit if may_draft_tree(req) else 0 for req, limit in zip(reqs, max_drafts)]
        drafts: list[list[int]] = [[] for _ in reqs]
        parents: list[list[int]] = [[] for _ in reqs]
        chains, logits = p._catch_up(reqs, limits)
        if logits is None:
            return Proposal(drafts)
        assert p._prev is not None, "the catch-up left no features"
        cands, beams = self._first_level(logits, p._prev)
        steps = min(self.steps, max(c.limit for c in chains))
        if steps > 1:
            self._expand(chains, cands, beams, steps)
        nodes = min(self.max_nodes, max(c.limit for c in chains), cands.count)
        tokens, links = self._select(cands, nodes)
        for chain, row_tokens, row_links in zip(chains, tokens, links):
            drafts[chain.index] = row_tokens[:chain.limit]
            parents[chain.index] = row_links[:chain.limit]
            chain.shadow.draft_end = chain.shadow.req.kv_len  # (no provisional head KV stays)
        self.num_trees += len(chains)
        return Proposal(drafts, parents=parents)

    def _first_level(self, logits: torch.Tensor, prev: torch.Tensor) -> tuple[_Candidates, _Beams]:
        """The top-K of the catch-up's last rows: the first candidates and beams, all children of the root."""
        k = self.topk
        scores, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [chains, K]
        tokens = self.proposer._to_target(ids)
        cand = torch.arange(k, device=logits.device).expand(logits.shape[0], k)
        cands = _Candidates([scores], [tokens], [torch.full_like(cand, -1)])
        return cands, _Beams(scores, tokens, cand, prev.repeat_interleave(k, dim=0))

    def _expand(self, chains: list[_Chain], cands: _Candidates, beams: _Beams, steps: int) -> None:
        """Levels 2..steps: one head pass over every beam, its top-K children scored, the K best kept as beams."""
        p, k = self.proposer, self.topk
        n = len(chains) * k
        rows = p.kv.req_pool.alloc(n)
        slots = p.kv.alloc_slots(n * (steps - 1)) if rows is not None else None
        if rows is None or slots is None:  # no room for the beams: a one-level tree
            if rows is not None:
                p.kv.req_pool.free(rows)
            return
        req_to_token = p.kv.req_pool.req_to_token
        kv_lens = [c.shadow.req.kv_len for c in chains for _ in range(k)]
        for i, chain in enumerate(chains):  # each beam's row starts as its request's head KV
            sreq = chain.shadow.req
            assert sreq.req_pool_idx is not None
            req_to_token[rows[i * k:(i + 1) * k], :sreq.kv_len] = req_to_token[sreq.req_pool_idx, :sreq.kv_len]
        rows_t = to_device(rows, torch.int64, p.device)
        starts_t = to_device(kv_lens, torch.int64, p.device)
        beam_reqs = [c.shadow.req for c in chains for _ in range(k)]
        try:
            loop = self.loop
            if loop is not None and loop.fits(len(chains), steps - 1, kv_lens):
                scores, tokens, parents = loop.run((beams.scores, beams.tokens, beams.features), kv_lens, rows,
                                                   slots.view(steps - 1, n), steps - 1)
                cands.scores, cands.tokens, cands.parents = [scores], [tokens], [parents]
                p.num_draft_passes += steps - 1
                return
            for step in range(1, steps):
                positions = [kv + step - 1 for kv in kv_lens]
                logits = self._pass(beam_reqs, beams, positions, rows, slots[(step - 1) * n:step * n])
                self._grow(cands, beams, logits, rows_t, starts_t, step)
        finally:
            p.kv.allocator.free(slots)
            p.kv.req_pool.free(rows)

    def _pass(self, beam_reqs: list[Req], beams: _Beams, positions: list[int], rows: list[int],
              slots: torch.Tensor) -> torch.Tensor:
        """One head DECODE pass feeding every beam's token and features at its depth's position."""
        p = self.proposer
        n = len(rows)
        p.head.draft_in[:n].copy_(beams.features)
        p.runner.last_tokens = beams.tokens.reshape(-1)
        batch = ScheduleBatch(ForwardMode.DECODE, beam_reqs, [0] * n, positions, slots, positions, [1] * n, rows,
                              future_rows=list(range(n)))
        p.num_draft_passes += 1
        return p.runner.forward(batch)

    def _grow(self, cands: _Candidates, beams: _Beams, logits: torch.Tensor, rows: torch.Tensor,
              starts: torch.Tensor, step: int) -> None:
        """Score the beams' children, keep the K best as the next beams (their rows take their parents' paths)."""
        p = self.proposer
        grown = expand_beams(logits, beams.scores, beams.cand, self.topk, p._to_target, cands.count)
        cands.scores.append(grown.scores)
        cands.tokens.append(grown.tokens)
        cands.parents.append(grown.parents)
        beams.features = p.head.hidden_out[:rows.shape[0]].index_select(0, grown.parent_beams)
        beams.scores, beams.tokens, beams.cand = grown.best_scores, grown.best_tokens, grown.best_cand
        copy_paths(p.kv.req_pool.req_to_token, rows, grown.parent_beams, starts, step)

    def _select(self, cands: _Candidates, nodes: int) -> tuple[list[list[int]], list[list[int]]]:
        """The `nodes` best candidates per request in candidate order (parents first): tokens and parent nodes."""
        scores = torch.cat(cands.scores, dim=1)
        tokens = torch.cat(cands.tokens, dim=1)
        parents = torch.cat(cands.parents, dim=1)
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :nodes]
        chosen = order.sort(dim=1).values  # [chains, nodes]
        place = torch.full_like(scores, -1, dtype=torch.int64)
        place.scatter_(1, chosen, torch.arange(nodes, device=scores.device).expand_as(chosen).contiguous())
        parent_cand = parents.gather(1, chosen)
        # -2: the root; -1: a parent that was not kept (never, by the argument above)
        parent_node = torch.where(parent_cand >= 0, place.gather(1, parent_cand.clamp(min=0)), -2)
        host = torch.stack([tokens.gather(1, chosen), parent_node]).tolist()  # the step's one read of its drafts
        assert all(x != -1 for row in host[1] for x in row), "a kept node's parent was not kept"
        return host[0], [[max(x, -1) for x in row] for row in host[1]]
