"""Oracle drafts, for benchmarks only: the target's own greedy continuation, recorded beforehand.

`bench speculative --oracle` runs every prompt on the plain engine first and hands each output to
`OracleProposer.record`; the speculative engine then proposes exactly what the target will emit,
so every draft is accepted and the measured speed-up is the ceiling the draft/verify machinery
allows. With `--speculative-draft-model SHAPE` the oracle also runs that draft model's passes
(catch-up and one decode per draft, KV kept and trimmed as for `draft`) and throws their tokens
away: the cycle costs what a real draft of that shape costs. `set_acceptance(a)` spoils a seeded
fraction of the proposals so that accepted / proposed is `a` in expectation.
"""

from __future__ import annotations

import logging
import random
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixmesh.engine.speculative.base import BaseProposer, Proposal, ProposerContext

if TYPE_CHECKING:
    from radixmesh.engine.request import Req
    from radixmesh.engine.speculative.draft_model import DraftModelProposer

logger = logging.getLogger(__name__)


@dataclass
class _Track:
    """A request's place in its recording: `checked` output tokens were compared with it."""

    recording: list[int]
    key: int
    checked: int = 0
    diverged: bool = False


def keep_probability(acceptance: float, num_drafts: int) -> float:
    """The chance `s` that each draft is left intact such that `mean(s, s^2, ..., s^k) = acceptance`: with the
    prefix rule (a draft counts only when all before it were accepted), accepted / proposed is then `acceptance`."""
    if acceptance >= 1.0 or num_drafts <= 0:
        return 1.0
    if acceptance <= 0.0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(1, num_drafts + 1)) / num_drafts < acceptance:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class OracleProposer(BaseProposer):
    """Replays recorded greedy continuations (keyed by prompt), optionally at a draft model's cost."""

    id = "oracle"

    def __init__(self, ctx: ProposerContext) -> None:
        self.vocab = ctx.target.model_config.vocab_size
        self.recordings: dict[tuple[int, ...], list[int]] = {}
        self.tracks: dict[str, _Track] = {}
        self.acceptance = 1.0
        self.seed = ctx.config.random_seed
        self._keep: dict[int, float] = {}
        self.cost: DraftModelProposer | None = None
        if ctx.config.speculative_draft_model is not None:
            from radixmesh.engine.speculative.draft_model import DraftModelProposer

            self.cost = DraftModelProposer(ctx)
            self.cost.device_drafts_ok = True  # its tokens are dropped: never read back
            self.relative_cost = self.cost.relative_cost
        self.num_spoiled = 0
        self.num_diverged = 0
        self.tie_margin = 0.0
        self._snapped = torch.zeros(1, dtype=torch.int64, device=ctx.target.device)
        logger.info("oracle drafts (benchmarks only), at the cost of %s",
                    ctx.config.speculative_draft_model or "nothing (no draft model)")

    # ---- set-up by the benchmark ------------------------------------------------------------
    def record(self, prompt: list[int], continuation: list[int]) -> None:
        """The target's greedy output for `prompt` (what the oracle will propose)."""
        self.recordings[tuple(prompt)] = list(continuation)

    def set_acceptance(self, acceptance: float, seed: int | None = None) -> None:
        """Spoil proposals so that accepted / proposed is `acceptance` (1.0: none spoiled)."""
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"oracle acceptance must be in [0, 1], got {acceptance}")
        self.acceptance = acceptance
        self._keep.clear()
        if seed is not None:
            self.seed = seed

    def set_tie_margin(self, margin: float) -> None:
        """Verify rows take the recorded token when its logit is within `margin` of the maximum (0: exact argmax
        only). Random weights in bf16 have near-ties that the decode and verify kernels break differently."""
        if margin < 0.0:
            raise ValueError(f"oracle tie margin must be >= 0, got {margin}")
        self.tie_margin = margin

    # ---- proposing --------------------------------------------------------------------------
    def propose(self, reqs: list[Req], max_drafts: list[int]) -> Proposal:
        limits = [min(limit, self._available(req)) for req, limit in zip(reqs, max_drafts)]
        if self.cost is not None and any(limits):
            paid = self.cost.propose(reqs, limits)  # the draft model's real passes; their tokens are dropped
            limits = [min(limit, len(d)) for limit, d in zip(limits, paid.drafts)]
        drafts: list[list[int]] = []
        for req, limit in zip(reqs, limits):
            drafts.append(self._drafts(req, limit) if limit > 0 else [])
        if self.tie_margin <= 0.0:
            return Proposal(drafts)
        snap = [self._expected(req, len(d) + 1) for req, d in zip(reqs, drafts)]
        return Proposal(drafts, snap_ids=snap, snap_margin=self.tie_margin, snap_count=self._snapped)

    def _expected(self, req: Req, rows: int) -> list[int]:
        """The recorded tokens the verify rows of `req` should emit (none once it left its recording)."""
        track = self.tracks.get(req.rid)
        if track is None or track.diverged:
            return []
        done = len(req.output_ids)
        return track.recording[done:done + rows]

    def _available(self, req: Req) -> int:
        """Recorded tokens after the request's current output (0 when none, or when it left the recording)."""
        track = self._track(req)
        if track is None:
            return 0
        out = req.output_ids
        end = min(len(out), len(track.recording))
        if not track.diverged and out[track.checked:end] != track.recording[track.checked:end]:
            track.diverged = True  # the target emitted another token than in the recording (e.g. bf16 rounding)
            self.num_diverged += 1
        track.checked = end
        if track.diverged or len(out) > len(track.recording):
            return 0
        return len(track.recording) - len(out)

    def _track(self, req: Req) -> _Track | None:
        track = self.tracks.get(req.rid)
        if track is None:
            key = tuple(req.origin_input_ids)
            recording = self.recordings.get(key)
            if recording is None:
                return None
            track = self.tracks[req.rid] = _Track(recording, zlib.crc32(repr(key).encode()))
        return track

    def _drafts(self, req: Req, limit: int) -> list[int]:
        track = self.tracks[req.rid]
        done = len(req.output_ids)
        drafts = track.recording[done:done + limit]
        if self.acceptance < 1.0:
            keep = self._keep.get(limit)
            if keep is None:
                keep = self._keep[limit] = keep_probability(self.acceptance, limit)
            for j, token in enumerate(drafts):
                rng = random.Random(f"{self.seed}:{track.key}:{done + j}")  # by request and position: any batching
                if rng.random() >= keep:
                    drafts[j] = (token + 1 + rng.randrange(self.vocab - 1)) % self.vocab
                    self.num_spoiled += 1
        return drafts

    # ---- per-request state ------------------------------------------------------------------
    def on_verified(self, req: Req, num_accepted: int) -> None:
        if self.cost is not None:
            self.cost.on_verified(req, num_accepted)

    def release(self, req: Req) -> None:
        self.tracks.pop(req.rid, None)
        if self.cost is not None:
            self.cost.release(req)

    def flush(self) -> bool:
        return self.cost.flush() if self.cost is not None else True

    def stats(self) -> dict[str, float | int]:
        stats: dict[str, float | int] = {"spec_oracle_spoiled": self.num_spoiled,
                                         "spec_oracle_diverged": self.num_diverged,
                                         "spec_oracle_snapped": int(self._snapped.item())}
        if self.cost is not None:
            stats.update(self.cost.stats())
        return stats
