"""Per-batch sampling tensors, built from the requests' `SamplingParams`, reused while they hold.

Most batches are plain (no penalties, no bias, no min_new_tokens), so every
`[batch, vocab]` tensor is optional and only built when some request needs it;
those are allocated on the device and filled from sparse indices, so only the ids
cross from the host. All-greedy batches need no per-row tensor at all. Host values
reach the device through `device_io` (pinned, non-blocking): building never waits for
the forward pass queued before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from radixmesh.engine.device_io import rows_to_device, tensor_to_device, to_device
from radixmesh.engine.grammar.vocab_mask import VocabMask
from radixmesh.wire.sampling import SamplingParams


@dataclass
class SamplingBatchInfo:
    """What the `Sampler` needs to know about each row of a logits batch."""

    vocab_size: int
    """Width of the logits this info applies to."""
    temperatures: torch.Tensor | None
    """[batch, 1] float32; greedy rows hold 1.0 so that dividing is always safe (None when all_greedy)."""
    top_ps: torch.Tensor | None
    """[batch] float32 nucleus mass in (0, 1] (None when all_greedy)."""
    top_ks: torch.Tensor | None
    """[batch] int64; `vocab_size` where top-k is disabled (None when all_greedy)."""
    min_ps: torch.Tensor | None
    """[batch] float32 in [0, 1] (None when all_greedy)."""
    is_greedy: torch.Tensor | None
    """[batch] bool: rows that take the argmax (temperature 0 or top_k 1) (None when all_greedy)."""
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
    return_logprobs: bool = False
    """Some row asks for the log-prob of its chosen token (or for top log-probs)."""
    top_logprobs_num: int = 0
    """Most top log-probs any row asks for (0: none)."""

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
        info = cls(
            vocab_size=vocab_size, temperatures=None, top_ps=None, top_ks=None, min_ps=None, is_greedy=None,
            all_greedy=all(greedy),
            need_top_k=any(k < vocab_size for k, g in zip(top_ks, greedy) if not g),
            need_top_p=any(p.top_p < 1.0 for p, g in zip(params, greedy) if not g),
            need_min_p=any(p.min_p > 0.0 for p, g in zip(params, greedy) if not g),
            seeds=[p.seed for p in params],
            output_lens=list(output_lens) if output_lens is not None else [len(ids) for ids in output_ids],
            return_logprobs=any(p.logprobs or p.top_logprobs > 0 for p in params),
            top_logprobs_num=max(p.top_logprobs for p in params),
        )
        if not info.all_greedy:
            info._build_columns(params, greedy, top_ks, device)
        info._build_logit_bias(params, device)
        info._build_penalties(params, prompt_ids, output_ids, device)
        info._build_min_tokens_mask(params, info.output_lens, eos_token_ids, device)
        return info

    @property
    def is_step_invariant(self) -> bool:
        """Nothing here depends on the step beyond `output_lens` (no penalties, no pending
        min_new_tokens ban), so the same rows may sample with it again."""
        return self.output_counts is None and self.seen_mask is None and self.min_tokens_mask is None

    def _build_columns(self, params: Sequence[SamplingParams], greedy: list[bool], top_ks: list[int],
                       device: torch.device) -> None:
        vocab = self.vocab_size
        # one host-to-device copy for all scalar columns: [batch, 5], the last one is_greedy
        columns = tensor_to_device(torch.tensor(
            [[1.0 if g else p.temperature, p.top_p, p.min_p, min(k, vocab), 1.0 if g else 0.0]
             for p, g, k in zip(params, greedy, top_ks)], dtype=torch.float32), device)
        self.temperatures = columns[:, 0:1]
        self.top_ps = columns[:, 1]
        self.min_ps = columns[:, 2]
        self.top_ks = columns[:, 3].to(torch.int64)
        self.is_greedy = columns[:, 4] != 0

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
        rows_t, cols_t = rows_to_device([rows, cols], device)
        bias_t[rows_t, cols_t] = to_device(values, torch.float32, device)
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
            self.seen_mask = _mask_of(bs, vocab, rows, cols, device)
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
        self.min_tokens_mask = _mask_of(len(params), vocab, rows, cols, device)


def _scatter_indices(ids_per_row: list[list[int]],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) index tensors on `device` for every id of every row, as index_put_ takes them."""
    rows = [row for row, ids in enumerate(ids_per_row) for _ in ids]
    cols = [token_id for ids in ids_per_row for token_id in ids]
    rows_t, cols_t = rows_to_device([rows, cols], device)
    return rows_t, cols_t


def _mask_of(bs: int, vocab: int, rows: torch.Tensor, cols: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[bs, vocab] bool, True at (rows, cols). The True values are made on the device: a host
    scalar (`mask[rows, cols] = True`) would be a blocking copy."""
    mask = torch.zeros(bs, vocab, dtype=torch.bool, device=device)
    mask.index_put_((rows, cols), torch.ones(rows.shape[0], dtype=torch.bool, device=device))
    return mask


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.float32, device).view(-1, 1)


class SamplingInfoCache:
    """Hands back the last batch's `SamplingBatchInfo` while the batch holds the same requests.

    A decode batch usually samples the same rows step after step; their info depends only on
    their params (fixed per request) and `output_lens`, which is refreshed. Infos that depend on
    the step (penalties over generated tokens, a pending min_new_tokens ban) are never kept.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.num_builds = 0
        self.num_reuses = 0
        self._rows: list[object] = []
        self._info: SamplingBatchInfo | None = None

    def get(self, rows: Sequence[object], output_lens: list[int],
            build: Callable[[], SamplingBatchInfo], keep: bool = True) -> SamplingBatchInfo:
        """The info for `rows` (compared by identity, in order); `build()` makes a fresh one, kept for the next call
        unless `keep` is False (a prefill's: made on another CUDA stream than the decode steps that would reuse it;
        the kept one stays)."""
        info = self._info
        if (info is not None and len(rows) == len(self._rows)
                and all(a is b for a, b in zip(rows, self._rows))):
            self.num_reuses += 1
            info.output_lens = output_lens
            info.vocab_mask = None
            return info
        info = build()
        self.num_builds += 1
        if not keep:
            return info
        cache = self.enabled and info.is_step_invariant
        self._rows, self._info = (list(rows), info) if cache else ([], None)
        return info
