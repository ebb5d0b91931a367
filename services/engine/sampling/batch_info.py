"""Per-batch sampling tensors, built once per step from the requests' `SamplingParams`.

Most batches are plain (no penalties, no bias, no min_new_tokens), so every
`[batch, vocab]` tensor is optional and only built when some request needs it;
those are allocated on the device and filled from sparse indices, so only the ids
cross from the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixmesh.engine.grammar.vocab_mask import VocabMask
from radixmesh.engine.sampling.params import SamplingParams


@dataclass
class SamplingBatchInfo:
    """What the `Sampler` needs to know about each row of a logits batch."""

    vocab_size: int
    """Width of the logits this info applies to."""
    temperatures: torch.Tensor
    """[batch, 1] float32; greedy rows hold 1.0 so that dividing is always safe."""
    top_ps: torch.Tensor
    """[batch] float32 nucleus mass in (0, 1]."""
    top_ks: torch.Tensor
    """[batch] int64; `vocab_size` where top-k is disabled."""
    min_ps: torch.Tensor
    """[batch] float32 in [0, 1]."""
    is_greedy: torch.Tensor
    """[batch] bool: rows that take the argmax (temperature 0 or top_k 1)."""
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    seeds: list[int | None]
    """Per-row seed, or None to draw from the sampler's shared generator."""
    output_lens: list[int]
    """Tokens generated so far per row: the step that seeded draws are keyed on."""
    logit_bias: torch.Tensor | None = None
    """[batch, vocab] float32 additive bias; None when no request has one."""
    output_counts: torch.Tensor | None = None
    """[batch, vocab] float32 occurrences in the output (not the prompt), for OpenAI penalties."""
    frequency_penalties: torch.Tensor | None = None
    """[batch, 1] float32; set together with `output_counts`."""
    presence_penalties: torch.Tensor | None = None
    """[batch, 1] float32; set together with `output_counts`."""
    seen_mask: torch.Tensor | None = None
    """[batch, vocab] bool: token occurs in prompt or output, for the repetition penalty."""
    repetition_penalties: torch.Tensor | None = None
    """[batch, 1] float32; set together with `seen_mask`."""
    min_tokens_mask: torch.Tensor | None = None
    """[batch, vocab] bool: EOS and stop ids banned until min_new_tokens were generated."""
    vocab_mask: VocabMask | None = None
    """Grammar rows' allowed tokens (packed bits, on the device); None when no row follows a grammar."""

    @property
    def batch_size(self) -> int:
        return len(self.seeds)

    @property
    def has_seeds(self) -> bool:
        return any(seed is not None for seed in self.seeds)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], prompt_ids: Sequence[list[int]],
              output_ids: Sequence[list[int]], eos_token_ids: Sequence[int], vocab_size: int,
              device: torch.device | str, output_lens: Sequence[int] | None = None) -> SamplingBatchInfo:
        """Tensors for one step; `prompt_ids[i]` and `output_ids[i]` belong to `params[i]`.

        `output_lens` overrides `len(output_ids[i])` where tokens were sampled on the device but
        are not on the host yet (overlap scheduling); it drives seeds and min_new_tokens.
        """
        assert len(params) == len(prompt_ids) == len(output_ids), (
            f"batch mismatch: {len(params)} params, {len(prompt_ids)} prompts, {len(output_ids)} outputs")
        assert len(params) > 0, "empty sampling batch"
        device = torch.device(device)
        greedy = [p.is_greedy for p in params]
        top_ks = [p.top_k if p.top_k >= 1 else vocab_size for p in params]
        # one host-to-device copy for all scalar columns: [batch, 4]
        columns = torch.tensor(
            [[1.0 if g else p.temperature, p.top_p, p.min_p, min(k, vocab_size)]
             for p, g, k in zip(params, greedy, top_ks)],
            dtype=torch.float32).to(device)
        info = cls(
            vocab_size=vocab_size,
            temperatures=columns[:, 0:1],
            top_ps=columns[:, 1],
            min_ps=columns[:, 2],
            top_ks=columns[:, 3].to(torch.int64),
            is_greedy=torch.tensor(greedy, dtype=torch.bool).to(device),
            all_greedy=all(greedy),
            need_top_k=any(k < vocab_size for k, g in zip(top_ks, greedy) if not g),
            need_top_p=any(p.top_p < 1.0 for p, g in zip(params, greedy) if not g),
            need_min_p=any(p.min_p > 0.0 for p, g in zip(params, greedy) if not g),
            seeds=[p.seed for p in params],
            output_lens=list(output_lens) if output_lens is not None else [len(ids) for ids in output_ids],
        )
        info._build_logit_bias(params, device)
        info._build_penalties(params, prompt_ids, output_ids, device)
        info._build_min_tokens_mask(params, info.output_lens, eos_token_ids, device)
        return info

    def _build_logit_bias(self, params: Sequence[SamplingParams], device: torch.device) -> None:
        if not any(p.logit_bias for p in params):
            return
        rows, cols, values = [], [], []
        for row, p in enumerate(params):
            for token_id, bias in p.logit_bias.items():
                rows.append(row)
                cols.append(int(token_id))
                values.append(float(bias))
        bias_t = torch.zeros(len(params), self.vocab_size, dtype=torch.float32, device=device)
        bias_t[_index(rows, device), _index(cols, device)] = torch.tensor(values).to(device)
        self.logit_bias = bias_t

    def _build_penalties(self, params: Sequence[SamplingParams], prompt_ids: Sequence[list[int]],
                         output_ids: Sequence[list[int]], device: torch.device) -> None:
        bs, vocab = len(params), self.vocab_size
        if any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params):
            rows, cols = _scatter_indices(
                [out if p.frequency_penalty != 0 or p.presence_penalty != 0 else []
                 for p, out in zip(params, output_ids)], device)
            counts = torch.zeros(bs, vocab, dtype=torch.float32, device=device)
            counts.index_put_((rows, cols), torch.ones(len(rows), device=device), accumulate=True)
            self.output_counts = counts
            self.frequency_penalties = _column([p.frequency_penalty for p in params], device)
            self.presence_penalties = _column([p.presence_penalty for p in params], device)
        if any(p.repetition_penalty != 1.0 for p in params):
            rows, cols = _scatter_indices(
                [prompt + out if p.repetition_penalty != 1.0 else []
                 for p, prompt, out in zip(params, prompt_ids, output_ids)], device)
            seen = torch.zeros(bs, vocab, dtype=torch.bool, device=device)
            seen[rows, cols] = True
            self.seen_mask = seen
            self.repetition_penalties = _column([p.repetition_penalty for p in params], device)

    def _build_min_tokens_mask(self, params: Sequence[SamplingParams], output_lens: Sequence[int],
                               eos_token_ids: Sequence[int], device: torch.device) -> None:
        vocab = self.vocab_size
        banned = [[t for t in (*eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab]
                  if out_len < p.min_new_tokens and not p.has_grammar else []  # a grammar decides when to end
                  for p, out_len in zip(params, output_lens)]
        if not any(banned):
            return
        rows, cols = _scatter_indices(banned, device)
        mask = torch.zeros(len(params), vocab, dtype=torch.bool, device=device)
        mask[rows, cols] = True
        self.min_tokens_mask = mask


def _scatter_indices(ids_per_row: list[list[int]],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) index tensors on `device` for every id of every row, as index_put_ takes them."""
    rows = [row for row, ids in enumerate(ids_per_row) for _ in ids]
    cols = [token_id for ids in ids_per_row for token_id in ids]
    return _index(rows, device), _index(cols, device)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(-1, 1).to(device)
