"""Acceptance of draft chains: greedy matching, rejection sampling, chain bookkeeping."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.sampling.batch_info import SamplingBatchInfo
from radixmesh.engine.sampling.sampler import Sampler
from radixmesh.engine.speculative.rejection import (
    ChainRows,
    accepted_lengths,
    chain_tokens,
    greedy_accept,
    residual_sample,
    sampled_accept,
    target_probs,
)
from radixmesh.wire.sampling import SamplingParams
from tests.unit.stats_helpers import chi_square_pvalue

VOCAB = 12


def _rows(drafts: list[list[int]]) -> ChainRows:
    nxt, seg, pos = [], [], []
    for i, d in enumerate(drafts):
        nxt += [*d, -1]
        seg += [i] * (len(d) + 1)
        pos += range(len(d) + 1)
    return ChainRows(torch.tensor(nxt), torch.tensor(seg), torch.tensor(pos), len(drafts))


def test_greedy_chains_keep_the_prefix_that_matches_the_argmax() -> None:
    drafts = [[3, 4, 5], [7, 7], [], [1]]
    rows = _rows(drafts)
    # target argmax per row: request 0 matches 3, 4 then differs; request 1 matches both; request 3 differs
    greedy = torch.tensor([3, 4, 9, 2, 7, 7, 8, 6, 0, 5])
    num_accepted = accepted_lengths(greedy_accept(greedy, rows), rows)
    assert num_accepted.tolist() == [2, 2, 0, 0]
    tokens = chain_tokens(rows, num_accepted, greedy).tolist()
    emitted = [tokens[s:s + n + 1] for s, n in zip([0, 4, 7, 8], num_accepted.tolist())]
    assert emitted == [[3, 4, 9], [7, 7, 8], [6], [0]]  # accepted drafts, then the target's own token


def _info(params: list[SamplingParams]) -> SamplingBatchInfo:
    return SamplingBatchInfo.build(params, [[1]] * len(params), [[]] * len(params), (), VOCAB, "cpu")


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.9, min_p=0.2),
], ids=["temperature", "top-k", "top-p", "min-p"])
def test_target_probs_is_what_the_sampler_draws_from(params: SamplingParams) -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    info = _info([params])
    probs = target_probs(logits, info)[0]
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-6)
    sampler = Sampler(seed=5)
    n = 20_000
    counts = torch.zeros(VOCAB)
    batch_info = _info([params] * 1000)
    for _ in range(n // 1000):
        ids = sampler(logits.expand(1000, VOCAB).contiguous(), batch_info).next_token_ids
        counts += torch.bincount(ids, minlength=VOCAB).float()
    assert (counts[probs == 0] == 0).all()  # truncation agrees
    assert chi_square_pvalue(counts, probs) > 1e-3


def _emitted(p: torch.Tensor, q: torch.Tensor | None, n: int, seed: int) -> torch.Tensor:
    """First emitted token of `n` one-draft chains: draft from q (argmax point mass when None), verify."""
    gen = torch.Generator().manual_seed(seed)
    if q is None:
        x = torch.full((n,), int(torch.argmax(p)))
    else:
        x = torch.multinomial(q, n, replacement=True, generator=gen)
    rows = ChainRows(torch.stack([x, torch.full_like(x, -1)], 1).reshape(-1),
                     torch.arange(n).repeat_interleave(2), torch.tensor([0, 1]).repeat(n), n)
    pp = p.expand(2 * n, -1)
    qq = q.expand(2 * n, -1) if q is not None else None
    accept = sampled_accept(pp, qq, rows, torch.rand(2 * n, generator=gen))
    final = residual_sample(pp, qq, rows, torch.rand(2 * n, generator=gen))
    num_accepted = accepted_lengths(accept, rows)
    return chain_tokens(rows, num_accepted, final).reshape(n, 2)[:, 0]


@pytest.mark.parametrize("kind", ["draft-model", "point-mass"])
def test_rejection_sampling_emits_the_target_distribution(kind: str) -> None:
    gen = torch.Generator().manual_seed(11)
    p = torch.softmax(torch.randn(VOCAB, generator=gen) * 1.5, 0)
    p[3] = 0.0  # a token the target never emits (e.g. masked by a grammar)
    p = p / p.sum()
    q = torch.softmax(torch.randn(VOCAB, generator=gen) * 1.5, 0) if kind == "draft-model" else None
    emitted = _emitted(p, q, 60_000, seed=2)
    counts = torch.bincount(emitted, minlength=VOCAB).float()
    assert counts[3] == 0
    assert chi_square_pvalue(counts, p) > 1e-3
    if q is not None:  # the check has power: the draft's own distribution is rejected
        assert chi_square_pvalue(torch.bincount(torch.multinomial(q, 60_000, True, generator=gen),
                                                minlength=VOCAB).float(), p) < 1e-6


def test_identical_draft_is_always_accepted() -> None:
    p = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(4)), 0)
    n = 5000
    x = torch.multinomial(p, n, replacement=True, generator=torch.Generator().manual_seed(1))
    rows = ChainRows(torch.stack([x, torch.full_like(x, -1)], 1).reshape(-1),
                     torch.arange(n).repeat_interleave(2), torch.tensor([0, 1]).repeat(n), n)
    accept = sampled_accept(p.expand(2 * n, -1), p.expand(2 * n, -1), rows, torch.rand(2 * n))
    assert accepted_lengths(accept, rows).eq(1).all()


def test_residual_with_no_mass_falls_back_to_the_target() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0]])
    rows = ChainRows(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]), 1)
    # q == p: the residual max(p - q, 0) is empty; the draw comes from p
    assert residual_sample(p, p.clone(), rows, torch.tensor([0.5])).tolist() == [1]
