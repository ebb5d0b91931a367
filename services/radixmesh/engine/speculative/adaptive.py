"""The back-off: how many drafts each request gets, and whether this batch size speculates at all.

Per request, acceptance decides the draft length. With each draft accepted with probability `a`
(estimated from the request's recent verifications), `k` drafts yield `E(k) = 1 + a + ... + a^k`
tokens per step for a cost of about `1 + c k` steps (`c`: one draft's cost relative to a target
step, plus verifying it); the request gets the `k` maximizing `E(k) / (1 + c k)`, which is 0 when
drafts do not pay. A request at 0 rests a few steps, then probes with one draft; each failed probe
doubles its rest, so one whose text turns repetitive later gets its drafts back.

Per batch size (buckets by powers of two), measured step time decides: tokens per second of
speculative steps against plain decode steps. When speculation loses (large batches are compute
bound, drafts cost too much or are rarely accepted), the bucket decodes plainly and probes again
after a rest that doubles while it keeps losing, so it comes back when it pays (speculation must be
faster by a margin: at parity, probing would cost more than it finds). The rest is also long enough
that probing costs at most PROBE_BUDGET of the plain steps: a probe that lost the time of `n` plain
steps is followed by at least `n / PROBE_BUDGET` of them.

A probe is cheap when drafts are known not to pay: requests whose acceptance says drafts pay draft
as usual, and only a sample of the others (those never verified first) draft, at least one each.
A request never verified takes the acceptance of recent verifications of other requests once there
are any (the draft model is the same for all), so an unrelated draft costs one sampled probe, not a
draft prefill of every prompt in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PRIOR_ACCEPTED = 0.6
PRIOR_TRIALS = 1.0
"""Pseudo-counts of an unseen request: acceptance 0.6 (before any verification; afterwards the recent
acceptance of all requests) until a few verifications say otherwise."""
COUNT_DECAY = 0.85
"""Weight of older verifications each time a new one is counted."""
MIN_REQUEST_REST, MAX_REQUEST_REST = 4, 64
"""Steps a request whose drafts do not pay waits before probing with one draft (doubling per failure)."""
VERIFY_TOKEN_COST = 0.1
"""Cost of verifying one extra token relative to one decode step (small for memory-bound passes)."""
RATE_EMA = 0.3
"""Weight of the newest step in a bucket's tokens-per-second averages."""
MIN_REST, MAX_REST = 4, 256
"""Plain steps before speculation is probed again in a bucket where it lost (doubling)."""
PLAIN_REFRESH = 64
"""Speculative steps after which a winning bucket runs one plain step to refresh its comparison."""
PROBE_BUDGET = 0.02
"""Most time probes of a losing batch size may cost, as a fraction of the plain steps between them."""
PROBE_SAMPLE = 4
"""Requests whose drafts are not known to pay that draft in a probe step (to learn their acceptance)."""
WIN_MARGIN = 0.05
"""Speculation counts as faster only above this relative margin: near parity, noisy step times would
otherwise flip the comparison and every flip resets the rest (probes, each a slower step, pile up)."""


@dataclass
class _Acceptance:
    accepted: float = 0.0
    trials: float = 0.0
    rest: int = 0
    """Steps left without drafts."""
    next_rest: int = MIN_REQUEST_REST
    probe_due: bool = False
    """The rest just ended: the next plan probes with one draft."""

    def rate(self, prior: float = PRIOR_ACCEPTED) -> float:
        return (self.accepted + prior * PRIOR_TRIALS) / (self.trials + PRIOR_TRIALS)


@dataclass
class BucketStats:
    """Tokens per second of the two kinds of decode steps at one batch-size bucket."""

    spec_rate: float | None = None
    plain_rate: float | None = None
    steps_since_spec: int = 0
    steps_since_plain: int = 0
    rest: int = MIN_REST

    @property
    def spec_wins(self) -> bool:
        return (self.spec_rate is not None and self.plain_rate is not None
                and self.spec_rate > self.plain_rate * (1 + WIN_MARGIN))


def best_draft_len(acceptance: float, cost: float, max_drafts: int) -> int:
    """The `k` in [0, max_drafts] maximizing `E(k) / (1 + cost k)`, `E(k) = sum(acceptance^i, i <= k)`."""
    best_k, best, expected, term = 0, 1.0, 1.0, 1.0
    for k in range(1, max_drafts + 1):
        term *= acceptance
        expected += term
        value = expected / (1.0 + cost * k)
        if value > best + 1e-9:
            best_k, best = k, value
    return best_k


def bucket_of(batch_size: int) -> int:
    """Batch sizes 1, 2-3, 4-7, 8-15, ... share statistics."""
    return max(batch_size, 1).bit_length()


class AdaptivePolicy:
    """Plans each decode step's draft lengths; learns from what the steps cost and produced."""

    def __init__(self, max_drafts: int, draft_cost: float, enabled: bool = True) -> None:
        assert max_drafts >= 1, f"max_drafts must be >= 1, got {max_drafts}"
        self.max_drafts = max_drafts
        self.cost = draft_cost + VERIFY_TOKEN_COST
        self.enabled = enabled
        self.requests: dict[str, _Acceptance] = {}
        self.population = _Acceptance()
        """Recent verifications of all requests: the prior of a request never verified."""
        self.buckets: dict[int, BucketStats] = {}
        self.num_backoff_steps = 0
        """Decode steps the batch-size rule ran without drafts."""

    def reset(self) -> None:
        """Forget what was learned (acceptance, step rates); the counters stay."""
        self.requests.clear()
        self.population = _Acceptance()
        self.buckets.clear()

    # ---- decisions --------------------------------------------------------------------------
    def plan(self, rids: list[str]) -> list[int]:
        """Draft budget per request for this step (all 0: decode without speculation)."""
        if not self.enabled:
            return [self.max_drafts] * len(rids)
        if not self.speculate(len(rids)):
            self.num_backoff_steps += 1
            return [0] * len(rids)
        if not self.buckets[bucket_of(len(rids))].spec_wins:
            return self._probe(rids)
        return [self.draft_len(rid) for rid in rids]

    def _probe(self, rids: list[str]) -> list[int]:
        """A step that measures speculation: requests whose drafts are known to pay draft as usual (rests
        aside); PROBE_SAMPLE of the others draft at least one, those never verified first."""
        known = self.population.trials > 0  # before any verification, no estimate is trusted
        accs = [self.requests.setdefault(rid, _Acceptance()) for rid in rids]
        plan = [self._estimate(acc) if known else 0 for acc in accs]
        others = sorted((acc.trials, i) for i, (acc, k) in enumerate(zip(accs, plan)) if k == 0)
        for _, i in others[:PROBE_SAMPLE]:
            plan[i] = max(self._estimate(accs[i]), 1)
        return plan

    def _estimate(self, acc: _Acceptance) -> int:
        """The draft length that pays at this acceptance (a request never verified: the population's)."""
        return best_draft_len(acc.rate(self.population.rate()), self.cost, self.max_drafts)

    def speculate(self, batch_size: int) -> bool:
        """Whether this batch size speculates now (measuring each mode first, then the faster one)."""
        stats = self.buckets.setdefault(bucket_of(batch_size), BucketStats())
        if stats.plain_rate is None:
            return False
        if stats.spec_rate is None:
            return True
        if stats.spec_wins:
            return stats.steps_since_plain < PLAIN_REFRESH
        return stats.steps_since_spec >= stats.rest

    def draft_len(self, rid: str) -> int:
        """Drafts for one request from its acceptance; when none pay it rests, then probes with one."""
        acc = self.requests.setdefault(rid, _Acceptance())
        if acc.rest > 0:
            acc.rest -= 1
            return 0
        k = self._estimate(acc)
        if k > 0:
            acc.next_rest, acc.probe_due = MIN_REQUEST_REST, False
            return k
        if acc.probe_due:
            acc.probe_due = False
            return 1
        acc.rest, acc.probe_due = acc.next_rest - 1, True
        acc.next_rest = min(2 * acc.next_rest, MAX_REQUEST_REST)
        return 0

    # ---- observations -----------------------------------------------------------------------
    def observe_request(self, rid: str, num_drafts: int, num_accepted: int) -> None:
        """A verification of `num_drafts` drafts accepted the first `num_accepted`."""
        if num_drafts <= 0:
            return
        # a chain stops at its first rejection: accepted drafts are successes, the rejected one a failure
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        for acc in (self.requests.setdefault(rid, _Acceptance()), self.population):
            acc.accepted = acc.accepted * COUNT_DECAY + num_accepted
            acc.trials = acc.trials * COUNT_DECAY + trials

    def observe_step(self, batch_size: int, speculated: bool, seconds: float, num_tokens: int) -> None:
        """One decode step of `batch_size` requests took `seconds` and produced `num_tokens` tokens."""
        if seconds <= 0 or num_tokens <= 0:
            return
        stats = self.buckets.setdefault(bucket_of(batch_size), BucketStats())
        rate = num_tokens / seconds
        if speculated:
            stats.spec_rate = rate if stats.spec_rate is None else (1 - RATE_EMA) * stats.spec_rate + RATE_EMA * rate
            stats.steps_since_spec = 0
            stats.steps_since_plain += 1
            if stats.plain_rate is not None:
                stats.rest = MIN_REST if stats.spec_wins else min(max(stats.rest * 2, _rest_for(
                    stats.plain_rate, batch_size, seconds, num_tokens)), MAX_REST)
        else:
            stats.plain_rate = rate if stats.plain_rate is None else (1 - RATE_EMA) * stats.plain_rate + RATE_EMA * rate
            stats.steps_since_plain = 0
            stats.steps_since_spec += 1

    def forget(self, rid: str) -> None:
        self.requests.pop(rid, None)

    def acceptance(self, rid: str) -> float:
        """The current acceptance estimate of a request (the prior when it was never verified)."""
        acc = self.requests.get(rid)
        return (acc or _Acceptance()).rate(self.population.rate())


def _rest_for(plain_rate: float, batch_size: int, seconds: float, num_tokens: int) -> int:
    """Plain steps after a losing probe that keep probing within PROBE_BUDGET: the probe lost the time
    of `lost` plain steps (its time minus what plain steps take for its tokens)."""
    plain_step_s = batch_size / plain_rate
    lost = (seconds - num_tokens / plain_rate) / plain_step_s
    return math.ceil(lost / PROBE_BUDGET) if lost > 0 else 0
