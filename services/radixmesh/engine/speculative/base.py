"""The proposer contract: what a draft source (n-gram lookup, draft model, EAGLE head, oracle) provides."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from radixmesh.engine.config import EngineConfig
    from radixmesh.engine.model_runner import ModelRunner
    from radixmesh.engine.request import Req


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer may use: the engine's settings, the target model and its tokenizer."""

    config: EngineConfig
    target: ModelRunner
    """The target's runner: its device, model config (vocabulary, EOS) and, for a head, its weights."""
    tokenizer: Any
    """The target's Hugging Face tokenizer (None when the engine runs on token ids only)."""


@dataclass
class Proposal:
    """Draft tokens of one decode step, per request in batch order."""

    drafts: list[list[int]]
    """Tokens that would follow each request's current tokens (empty: no drafts for it)."""
    draft_probs: torch.Tensor | None = None
    """[rows, vocab] float32 on the target's device: row `prob_rows[i] + j` is the distribution draft j
    of request i was drawn from. None: every draft is deterministic (a point mass), as lookups are."""
    prob_rows: list[int] = field(default_factory=list)
    """First row of each request's drafts in `draft_probs` (fixed when the proposal is made, so that
    shortening `drafts` later keeps rows aligned), and in `device_drafts`."""
    device_drafts: torch.Tensor | None = None
    """[drafts] int64 on the target's device, laid out as `prob_rows` says: the drafts' values when they never
    went to the host (`drafts` then holds placeholders of the right lengths; see `device_drafts_ok`)."""
    parents: list[list[int]] | None = None
    """Draft trees (EAGLE with --speculative-eagle-topk > 1): per request, each draft's parent draft (-1: the
    request's last token), parents before children, so that any leading part of a list is a tree too. None: each
    request's drafts are a chain. Only greedy requests get trees (their verification is exact argmax matching)."""

    snap_ids: list[list[int]] | None = None
    """Benchmarks only (the oracle): per request, the token expected at each of its verify rows (-1: none). A greedy
    row whose target logit for that token is within `snap_margin` of its maximum takes it as the argmax, so bf16
    near-ties of random weights do not move the target off its recorded path."""
    snap_margin: float = 0.0
    snap_count: torch.Tensor | None = None
    """[1] int64 on the device: rows whose argmax the snap changed are added here."""

    @property
    def num_drafts(self) -> int:
        return sum(len(d) for d in self.drafts)


class BaseProposer(abc.ABC):
    """Proposes draft tokens for decoding requests; the verifier checks them in one target pass.

    Contract:

    - `propose(reqs, max_drafts)` returns, for each `reqs[i]`, at most `max_drafts[i]` tokens that
      would follow `reqs[i].all_ids` (its prompt and output; the last output token has no KV in the
      target yet). Fewer (or none) is always allowed. With `draft_probs`, a sampled request's draft
      j must have been drawn from row j's distribution (rejection sampling divides by it); greedy
      requests' drafts may be anything.
    - `on_verified(req, num_accepted)` follows every proposal that reached verification, once the
      request's tokens include the accepted drafts and the token after them (and may have been cut
      by a stop). A proposer keeping state per request (a draft model's KV) trims it there.
    - `release(req)` when the request left decoding (finished, aborted, retracted): free its state.
    - `flush()` drops caches (the engine's flush_cache); False when it cannot (requests hold state).

    EAGLE heads (eagle.py) implement the same calls; the target's features reach them through the
    target model's `HiddenCapture` (models/llama.py), not through this contract.
    """

    id: str
    """Registry id (kebab-case), as in --speculative-algorithm."""
    relative_cost: float = 0.0
    """Cost of one draft token relative to one target decode step; the back-off weighs drafts with it."""
    device_drafts_ok: bool = False
    """Set by the decoder before each `propose`: the batch reads no draft values on the host (greedy requests
    without grammar or penalties), so a proposer may leave them on the device (`Proposal.device_drafts`)."""

    @abc.abstractmethod
    def propose(self, reqs: list[Req], max_drafts: list[int]) -> Proposal: ...

    def on_verified(self, req: Req, num_accepted: int) -> None:  # noqa: B027 (optional hook)
        """The target accepted the first `num_accepted` drafts of `req`'s last proposal."""

    def release(self, req: Req) -> None:  # noqa: B027 (optional hook)
        """`req` left decoding: drop what is kept for it."""

    def flush(self) -> bool:
        return True

    def stats(self) -> dict[str, float | int]:
        return {}
