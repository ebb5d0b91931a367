"""Accepting draft chains: exact argmax matching for greedy rows, rejection sampling for the others.

Rows are the verify pass's tokens, request by request: row `i` of a request with `k` drafts holds
the target's logits after its first `i` drafts (`i = 0..k`). A draft row also names the draft
token it checks (`draft_next`); the last row of each request checks nothing (-1) and gives the
bonus token when every draft was accepted.

Rejection sampling (Leviathan et al., Chen et al.): draft `x` drawn from `q` is kept with
probability `min(1, p(x) / q(x))`; at the first rejection the token is drawn from
`normalize(max(p - q, 0))`. Each emitted token then follows the target distribution `p` exactly,
whatever `q` is. A deterministic draft (n-gram) is a point mass: kept with probability `p(x)`,
replaced by a draw from `p` with `x` removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixmesh.engine.sampling.batch_info import SamplingBatchInfo
from radixmesh.engine.sampling.sampler import _truncate_sorted


@dataclass
class ChainRows:
    """Device tensors describing the rows of one verify pass (all `[rows]`)."""

    draft_next: torch.Tensor
    """int64: the draft token each row checks, -1 on each request's last row."""
    segment: torch.Tensor
    """int64: the request (batch row) each row belongs to."""
    position: torch.Tensor
    """int64: drafts before this row within its request (0 for the first)."""
    num_reqs: int


def target_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """[rows, vocab] float32: the distribution the `Sampler` draws each non-greedy row from
    (temperature, then top-k, top-p and min-p over the processed logits), in vocabulary order."""
    assert info.temperatures is not None, "target_probs needs a batch with sampled rows"
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    probs_sorted, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    probs_sorted = _truncate_sorted(probs_sorted, info)
    kept = torch.zeros_like(probs).scatter_(1, order, probs_sorted)
    return kept / kept.sum(dim=-1, keepdim=True)


def accepted_lengths(accept: torch.Tensor, rows: ChainRows) -> torch.Tensor:
    """[num_reqs] int64: how many leading drafts of each request were accepted."""
    big = torch.iinfo(torch.int64).max
    first_reject = torch.where(accept, torch.full_like(rows.position, big), rows.position)
    out = torch.full((rows.num_reqs,), big, dtype=torch.int64, device=accept.device)
    return out.scatter_reduce(0, rows.segment, first_reject, reduce="amin", include_self=True)


def greedy_accept(greedy_ids: torch.Tensor, rows: ChainRows) -> torch.Tensor:
    """[rows] bool: the draft equals the target's argmax."""
    return (rows.draft_next >= 0) & (rows.draft_next == greedy_ids)


def sampled_accept(p: torch.Tensor, q: torch.Tensor | None, rows: ChainRows, uniforms: torch.Tensor) -> torch.Tensor:
    """[rows] bool: `uniforms < p(x) / q(x)` for each row's draft `x` (q None: point masses, q(x) = 1)."""
    is_draft = rows.draft_next >= 0
    x = rows.draft_next.clamp(min=0).unsqueeze(1)
    p_x = p.gather(1, x).squeeze(1)
    q_x = q.gather(1, x).squeeze(1).clamp(min=1e-30) if q is not None else torch.ones_like(p_x)
    return is_draft & (uniforms < p_x / q_x)


def residual_sample(p: torch.Tensor, q: torch.Tensor | None, rows: ChainRows, uniforms: torch.Tensor) -> torch.Tensor:
    """[rows] int64: a draw from `normalize(max(p - q, 0))` on draft rows and from `p` on last rows.

    If the residual has no mass (p and q equal up to rounding) the draw is from `p`.
    """
    is_draft = (rows.draft_next >= 0).unsqueeze(1)
    if q is None:
        q = torch.zeros_like(p).scatter_(1, rows.draft_next.clamp(min=0).unsqueeze(1), 1.0)
    residual = torch.where(is_draft, (p - q).clamp(min=0.0), p)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    return inverse_cdf(residual, uniforms)


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[rows] int64: one draw per row from unnormalized non-negative `weights` [rows, vocab]."""
    sorted_w, order = torch.sort(weights, dim=-1, descending=True, stable=True)
    cdf = torch.cumsum(sorted_w, dim=-1)
    pos = torch.searchsorted(cdf, (uniforms.unsqueeze(1) * cdf[:, -1:]).contiguous(), right=True)
    num_kept = (sorted_w > 0).sum(dim=-1, keepdim=True)
    pos = torch.minimum(pos, (num_kept - 1).clamp(min=0))
    return order.gather(1, pos).squeeze(1)


def chain_tokens(rows: ChainRows, num_accepted: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """[rows] int64: row i of a request with n accepted drafts emits draft i+1 for i < n, `final`
    at i = n; rows past n are not emitted (their values are meaningless)."""
    keep_draft = rows.position < num_accepted.index_select(0, rows.segment)
    return torch.where(keep_draft, rows.draft_next, final)
