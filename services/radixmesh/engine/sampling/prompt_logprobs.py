"""Log-probs of prompt tokens: each one scored under the raw logits of the position before it.

Unlike the sampler's output log-probs, no bias, penalty or temperature applies: these describe
the model's own distribution, which is what scoring a text (SGLang's `select`) needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixmesh.engine.device_io import to_device


@dataclass
class PromptLogprobs:
    """Scores of one pass's prompt tokens, on the device (they reach the host with the sampled tokens)."""

    logprobs: torch.Tensor
    """[num_rows] float32 log-prob of each scored token."""
    top_ids: torch.Tensor | None = None
    """[num_rows, k] int64 most likely tokens at each position, most likely first."""
    top_values: torch.Tensor | None = None
    """[num_rows, k] float32 their log-probs."""


def top_pairs(ids: torch.Tensor | None, values: torch.Tensor | None) -> list[list[tuple[int, float]]] | None:
    """Per row, (token, log-prob) pairs from host tensors `[rows, k]`; None when there are none."""
    if ids is None or values is None:
        return None
    assert ids.device.type == "cpu" and values.device.type == "cpu", "top_pairs reads host copies"
    return [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]


def score_prompt_tokens(logits: torch.Tensor, targets: list[int], top_n: int) -> PromptLogprobs:
    """`logits` [num_rows, vocab] of the positions before `targets`; `top_n` alternatives (0: none)."""
    assert logits.dim() == 2 and logits.shape[0] == len(targets), (
        f"logits {tuple(logits.shape)} do not match {len(targets)} scored tokens")
    logprobs_all = torch.log_softmax(logits.float(), dim=-1)  # [num_rows, vocab]
    index = to_device(targets, torch.int64, logits.device).unsqueeze(1)
    scored = PromptLogprobs(logprobs_all.gather(1, index).squeeze(1))
    if top_n > 0:
        scored.top_values, scored.top_ids = torch.topk(logprobs_all, min(top_n, logits.shape[-1]), dim=-1)
    return scored
