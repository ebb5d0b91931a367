"""Log-probs of prompt tokens: each one scored under the raw logits of the position before it.

Unlike the sampler's output log-probs, no bias, penalty or temperature applies: these describe
the model's own distribution, which is what scoring a text (SGLang's `select`) needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PromptLogprobs:
    """Scores of one pass's prompt tokens, still on the device until `to_lists`."""

    logprobs: torch.Tensor
    """[num_rows] float32 log-prob of each scored token."""
    top_ids: torch.Tensor | None = None
    """[num_rows, k] int64 most likely tokens at each position, most likely first."""
    top_values: torch.Tensor | None = None
    """[num_rows, k] float32 their log-probs."""

    def to_lists(self) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
        """Host copies (a device sync): log-probs, and per row the (token, log-prob) alternatives."""
        values: list[float] = self.logprobs.tolist()
        if self.top_ids is None or self.top_values is None:
            return values, None
        tops = [list(zip(ids, lps)) for ids, lps in zip(self.top_ids.tolist(), self.top_values.tolist())]
        return values, tops


def score_prompt_tokens(logits: torch.Tensor, targets: list[int], top_n: int) -> PromptLogprobs:
    """`logits` [num_rows, vocab] of the positions before `targets`; `top_n` alternatives (0: none)."""
    assert logits.dim() == 2 and logits.shape[0] == len(targets), (
        f"logits {tuple(logits.shape)} do not match {len(targets)} scored tokens")
    logprobs_all = torch.log_softmax(logits.float(), dim=-1)  # [num_rows, vocab]
    index = torch.tensor(targets, dtype=torch.int64, device=logits.device).unsqueeze(1)
    scored = PromptLogprobs(logprobs_all.gather(1, index).squeeze(1))
    if top_n > 0:
        scored.top_values, scored.top_ids = torch.topk(logprobs_all, min(top_n, logits.shape[-1]), dim=-1)
    return scored
