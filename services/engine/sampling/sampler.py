"""Batched token sampling: logit processing, log-probs, truncation and seeded draws.

Order of operations on each row of `[batch, vocab]` logits:

1. cast to float32, add `logit_bias`;
2. repetition penalty (HF: positive logits divided, negative multiplied), then
   frequency and presence penalties (OpenAI: over generated tokens only);
3. ban EOS and stop ids while fewer than `min_new_tokens` were generated, then set
   tokens a row's grammar does not allow to -inf (grammar rows only);
4. log-probs = log_softmax of these processed logits, i.e. BEFORE temperature and
   truncation, so they describe the model's (penalised) distribution and do not
   depend on how the token was drawn;
5. greedy rows take the argmax; other rows divide by the temperature, softmax,
   keep the top-k, then the top-p of the renormalised mass, then drop tokens under
   min_p times the top probability, and draw by inverse CDF over what is left.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixmesh.engine.grammar.vocab_mask import apply_vocab_mask
from radixmesh.engine.sampling.batch_info import SamplingBatchInfo
from radixmesh.engine.sampling.prompt_logprobs import PromptLogprobs

SEED_STEP_MULTIPLIER = 1_000_003
SEED_MASK = (1 << 63) - 1


@dataclass
class SampleOutput:
    """The sampled tokens of one step and, when asked for, their log-probs."""

    next_token_ids: torch.Tensor
    """[batch] int64."""
    logprobs: torch.Tensor | None = None
    """[batch] float32 log-prob of each chosen token under the processed logits."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per row, the most likely (token, logprob) pairs in descending order; callers slice to their k."""
    prompt_logprobs: PromptLogprobs | None = None
    """Log-probs of prompt tokens scored in this pass (set by the model runner, not the sampler)."""


class Sampler:
    """Picks the next token of every row; `seed` drives rows whose request has no seed."""

    def __init__(self, seed: int | None = None) -> None:
        self._shared = torch.Generator(device="cpu")
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed & SEED_MASK)
        self._seeded = torch.Generator(device="cpu")

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo, return_logprobs: bool = False,
                 top_logprobs_num: int = 0) -> SampleOutput:
        assert logits.dim() == 2, f"logits must be [batch, vocab], got shape {tuple(logits.shape)}"
        assert logits.shape == (info.batch_size, info.vocab_size), (
            f"logits {tuple(logits.shape)} do not match the batch info "
            f"({info.batch_size}, {info.vocab_size})")
        logits = process_logits(logits, info)
        greedy_ids = torch.argmax(logits, dim=-1)
        if info.all_greedy:
            next_ids = greedy_ids
        else:
            sampled = self._draw(logits, info)
            next_ids = torch.where(info.is_greedy, greedy_ids, sampled)
        out = SampleOutput(next_token_ids=next_ids)
        if return_logprobs or top_logprobs_num > 0:
            logprobs_all = torch.log_softmax(logits, dim=-1)
            if return_logprobs:
                out.logprobs = logprobs_all.gather(1, next_ids.unsqueeze(1)).squeeze(1)
            if top_logprobs_num > 0:
                out.top_logprobs = _top_logprobs(logprobs_all, top_logprobs_num)
        return out

    def _draw(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        # sorted order makes truncation a prefix and the inverse CDF deterministic
        probs_sorted, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        probs_sorted = _truncate_sorted(probs_sorted, info)
        cdf = torch.cumsum(probs_sorted, dim=-1)
        total = cdf[:, -1:]
        uniforms = self._uniforms(info).to(logits.device)
        pos = torch.searchsorted(cdf, uniforms.unsqueeze(1) * total, right=True)
        num_kept = (probs_sorted > 0).sum(dim=-1, keepdim=True)
        pos = torch.minimum(pos, (num_kept - 1).clamp(min=0))
        return order.gather(1, pos).squeeze(1)

    def _uniforms(self, info: SamplingBatchInfo) -> torch.Tensor:
        """[batch] float32 in [0, 1): seeded rows depend only on (seed, tokens generated so far)."""
        uniforms = torch.rand(info.batch_size, generator=self._shared, dtype=torch.float32)
        for row, (seed, step) in enumerate(zip(info.seeds, info.output_lens)):
            if seed is not None:
                self._seeded.manual_seed(seeded_step_key(seed, step))
                uniforms[row] = torch.rand(1, generator=self._seeded, dtype=torch.float32)[0]
        return uniforms


def seeded_step_key(seed: int, step: int) -> int:
    """The generator seed of a request's draw at `step` (tokens generated before it)."""
    return (seed * SEED_STEP_MULTIPLIER + step) & SEED_MASK


def process_logits(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Float32 copy of `logits` with bias, penalties, the min_new_tokens ban and grammar masks applied."""
    logits = logits.to(torch.float32, copy=True)
    if info.logit_bias is not None:
        logits += info.logit_bias
    if info.seen_mask is not None:
        assert info.repetition_penalties is not None
        penalised = torch.where(logits > 0, logits / info.repetition_penalties,
                                logits * info.repetition_penalties)
        logits = torch.where(info.seen_mask, penalised, logits)
    if info.output_counts is not None:
        assert info.frequency_penalties is not None and info.presence_penalties is not None
        logits -= info.frequency_penalties * info.output_counts
        logits -= info.presence_penalties * (info.output_counts > 0).to(torch.float32)
    if info.min_tokens_mask is not None:
        logits.masked_fill_(info.min_tokens_mask, float("-inf"))
    if info.vocab_mask is not None:
        apply_vocab_mask(logits, info.vocab_mask)
    return logits


def _truncate_sorted(probs_sorted: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zero the sorted probabilities that top-k, top-p or min-p drop; the kept ones stay a prefix."""
    vocab = probs_sorted.shape[-1]
    if info.need_top_k:
        ranks = torch.arange(vocab, device=probs_sorted.device).unsqueeze(0)
        probs_sorted = probs_sorted.masked_fill(ranks >= info.top_ks.unsqueeze(1), 0.0)
    if info.need_top_p:
        cdf = torch.cumsum(probs_sorted, dim=-1)
        mass_before = cdf - probs_sorted
        limit = info.top_ps.unsqueeze(1) * cdf[:, -1:]
        drop = (mass_before > limit) & (info.top_ps < 1.0).unsqueeze(1)
        probs_sorted = probs_sorted.masked_fill(drop, 0.0)
    if info.need_min_p:
        threshold = info.min_ps.unsqueeze(1) * probs_sorted[:, :1]
        probs_sorted = probs_sorted.masked_fill(probs_sorted < threshold, 0.0)
    return probs_sorted


def _top_logprobs(logprobs_all: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    values, ids = torch.topk(logprobs_all, min(k, logprobs_all.shape[-1]), dim=-1, sorted=True)
    return [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
