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

from radixmesh.engine.device_io import HostCopy, tensor_to_device
from radixmesh.engine.grammar.vocab_mask import apply_vocab_mask
from radixmesh.engine.sampling.batch_info import SamplingBatchInfo
from radixmesh.engine.sampling.prompt_logprobs import PromptLogprobs, top_pairs

SEED_STEP_MULTIPLIER = 1_000_003
SEED_MASK = (1 << 63) - 1


TopLogprobs = list[list[tuple[int, float]]]
"""Per row, the most likely (token, logprob) pairs in descending order."""


@dataclass
class HostSample:
    """One step's results as host values (what the scheduler appends to its requests)."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: TopLogprobs | None = None
    """Per row, as many pairs as the batch's largest ask; callers slice to their k."""
    prompt_logprobs: list[float] | None = None
    """Log-probs of the prompt tokens scored in this pass, in plan order."""
    prompt_top_logprobs: TopLogprobs | None = None

    def token_rows(self, row: int) -> range:
        """Rows of `token_ids` that batch row `row` appends, in order (one; several after verification)."""
        return range(row, row + 1)


@dataclass
class SampleOutput:
    """The sampled tokens of one step and, when asked for, their log-probs (device tensors)."""

    next_token_ids: torch.Tensor
    """[batch] int64."""
    logprobs: torch.Tensor | None = None
    """[batch] float32 log-prob of each chosen token under the processed logits."""
    top_logprob_ids: torch.Tensor | None = None
    """[batch, k] int64 most likely tokens of each row, most likely first."""
    top_logprob_values: torch.Tensor | None = None
    """[batch, k] float32 their log-probs."""
    prompt_logprobs: PromptLogprobs | None = None
    """Log-probs of prompt tokens scored in this pass (set by the model runner, not the sampler)."""
    host_copy: HostCopy | None = None
    """The copy to the host started by `start_copy`."""

    def start_copy(self) -> None:
        """Start copying everything the host reads (no wait); call once all of it is queued."""
        prompt = self.prompt_logprobs
        self.host_copy = HostCopy([
            self.next_token_ids, self.logprobs, self.top_logprob_ids, self.top_logprob_values,
            prompt.logprobs if prompt is not None else None, prompt.top_ids if prompt is not None else None,
            prompt.top_values if prompt is not None else None])

    def to_host(self) -> HostSample:
        """Host values; waits for this output's copy only (starting it first if nobody did)."""
        if self.host_copy is None:
            self.start_copy()
        assert self.host_copy is not None
        ids, logprobs, top_ids, top_values, prompt, prompt_ids, prompt_values = self.host_copy.wait()
        assert ids is not None
        return HostSample(
            token_ids=ids.tolist(),
            logprobs=logprobs.tolist() if logprobs is not None else None,
            top_logprobs=top_pairs(top_ids, top_values),
            prompt_logprobs=prompt.tolist() if prompt is not None else None,
            prompt_top_logprobs=top_pairs(prompt_ids, prompt_values))


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
        greedy_ids = argmax(logits)
        if info.all_greedy:
            next_ids = greedy_ids
        else:
            assert info.is_greedy is not None, "a sampling batch without its per-row columns"
            sampled = self._draw(logits, info)
            next_ids = torch.where(info.is_greedy, greedy_ids, sampled)
        out = SampleOutput(next_token_ids=next_ids)
        if return_logprobs or top_logprobs_num > 0:
            logprobs_all = torch.log_softmax(logits, dim=-1)
            if return_logprobs:
                out.logprobs = logprobs_all.gather(1, next_ids.unsqueeze(1)).squeeze(1)
            if top_logprobs_num > 0:
                out.top_logprob_values, out.top_logprob_ids = torch.topk(
                    logprobs_all, min(top_logprobs_num, logprobs_all.shape[-1]), dim=-1, sorted=True)
        return out

    def _draw(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        assert info.temperatures is not None, "a sampling batch without its per-row columns"
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        # sorted order makes truncation a prefix and the inverse CDF deterministic
        probs_sorted, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        probs_sorted = _truncate_sorted(probs_sorted, info)
        cdf = torch.cumsum(probs_sorted, dim=-1)
        total = cdf[:, -1:]
        uniforms = tensor_to_device(self._uniforms(info), logits.device)
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


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax `[batch]` int64; on CUDA the chunked kernel (PyTorch's is one block per row)."""
    if logits.is_cuda:
        from radixmesh.kernels.argmax import argmax_rows

        return argmax_rows(logits)
    return torch.argmax(logits, dim=-1)


def seeded_step_key(seed: int, step: int) -> int:
    """The generator seed of a request's draw at `step` (tokens generated before it)."""
    return (seed * SEED_STEP_MULTIPLIER + step) & SEED_MASK


def process_logits(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Float32 `logits` with bias, penalties, the min_new_tokens ban and grammar masks applied.

    A copy whenever something applies; float32 logits that need nothing come back as they are
    (never modified in place either way).
    """
    if (info.logit_bias is None and info.seen_mask is None and info.output_counts is None
            and info.min_tokens_mask is None and info.vocab_mask is None):
        return logits.float()
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
    assert info.top_ks is not None and info.top_ps is not None and info.min_ps is not None
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
