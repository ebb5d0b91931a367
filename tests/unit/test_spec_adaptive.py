"""The back-off of speculative decoding: draft lengths per request, on/off per batch size."""

from __future__ import annotations

import itertools

import pytest

from radixmesh.engine.speculative.adaptive import (
    MAX_REQUEST_REST,
    MAX_REST,
    MIN_REQUEST_REST,
    MIN_REST,
    PROBE_BUDGET,
    PROBE_SAMPLE,
    AdaptivePolicy,
    BucketStats,
    best_draft_len,
    bucket_of,
)


def test_draft_length_grows_with_acceptance_and_shrinks_with_cost() -> None:
    assert best_draft_len(0.0, 0.05, 8) == 0
    assert best_draft_len(0.02, 0.05, 8) == 0  # a draft accepted 2% of the time costs more than it brings
    lens = [best_draft_len(a, 0.05, 8) for a in (0.2, 0.5, 0.8, 0.95)]
    assert lens == sorted(lens) and lens[0] >= 1 and lens[-1] == 8
    assert best_draft_len(0.6, 1.0, 8) == 0  # a draft as costly as a target step never pays at 60%
    assert best_draft_len(0.99, 0.3, 4) == 4  # capped


def test_bucket_of_groups_powers_of_two() -> None:
    assert [bucket_of(b) for b in (1, 2, 3, 4, 7, 8, 33)] == [1, 2, 2, 3, 3, 4, 6]


def _run_steps(policy: AdaptivePolicy, batch_size: int, steps: int, plain_rate: float, spec_rate: float) -> list[bool]:
    """Drive the policy: each step takes 1 s and yields `rate` tokens; returns when it speculated."""
    modes = []
    for _ in range(steps):
        speculated = policy.speculate(batch_size)
        modes.append(speculated)
        policy.observe_step(batch_size, speculated, 1.0, int(spec_rate if speculated else plain_rate))
    return modes


def test_batch_size_backs_off_when_speculation_loses_and_probes_rarely() -> None:
    policy = AdaptivePolicy(4, 0.0)
    modes = _run_steps(policy, 32, 400, plain_rate=100, spec_rate=80)
    assert modes[0] is False and modes[1] is True  # measures plain decode, then speculation
    probes = sum(modes[2:])
    assert 2 <= probes <= 10, probes  # then only probes, ever rarer (rests double up to MAX_REST)
    gaps = [i for i, m in enumerate(modes) if m]
    assert gaps[-1] - gaps[-2] == MAX_REST + 1 or gaps[-1] - gaps[-2] > 64
    assert policy.buckets[bucket_of(32)].rest == MAX_REST


def test_batch_size_that_wins_keeps_speculating_and_refreshes_plain() -> None:
    policy = AdaptivePolicy(4, 0.0)
    modes = _run_steps(policy, 1, 200, plain_rate=100, spec_rate=250)
    assert sum(modes) >= 190  # plain only to measure it now and then
    assert not all(modes[2:])


def test_comes_back_when_it_pays() -> None:
    policy = AdaptivePolicy(4, 0.0)
    _run_steps(policy, 8, 300, plain_rate=100, spec_rate=60)  # losing: backed off
    modes = _run_steps(policy, 8, 2 * MAX_REST + 20, plain_rate=100, spec_rate=300)  # now it pays
    assert sum(modes[-20:]) >= 18
    assert policy.buckets[bucket_of(8)].rest == MIN_REST


def test_batch_sizes_are_judged_separately() -> None:
    policy = AdaptivePolicy(4, 0.0)
    _run_steps(policy, 1, 50, plain_rate=100, spec_rate=200)
    _run_steps(policy, 64, 50, plain_rate=1000, spec_rate=500)
    assert policy.buckets[bucket_of(1)].spec_wins and not policy.buckets[bucket_of(64)].spec_wins
    assert policy.speculate(1)


def test_request_that_stops_accepting_backs_off_then_probes_ever_rarer() -> None:
    policy = AdaptivePolicy(4, 0.1)
    assert policy.draft_len("a") >= 2  # the prior
    lens = []
    for _ in range(200):
        k = policy.draft_len("a")
        lens.append(k)
        policy.observe_request("a", k, 0)
    first_zero = lens.index(0)
    assert first_zero <= 4  # a few failed verifications are enough
    probes = [i for i in range(first_zero, 200) if lens[i]]
    assert all(lens[i] == 1 for i in probes)  # probes use one draft
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert probes[0] - first_zero == MIN_REQUEST_REST  # rests of 4, 8, 16, ... steps between probes
    assert gaps == sorted(gaps) and gaps[0] == 2 * MIN_REQUEST_REST + 1 and gaps[-1] == MAX_REQUEST_REST + 1
    assert policy.draft_len("b") == 0  # a new request starts from the others' recent acceptance


def test_request_whose_probe_succeeds_gets_its_drafts_back() -> None:
    policy = AdaptivePolicy(4, 0.1)
    while (k := policy.draft_len("a")) != 0:
        policy.observe_request("a", k, 0)
    for _ in range(30):
        k = policy.draft_len("a")
        policy.observe_request("a", k, k)  # the text turned repetitive: every draft accepted
    assert policy.draft_len("a") == 4


def test_request_that_accepts_everything_gets_the_most_drafts() -> None:
    policy = AdaptivePolicy(6, 0.05)
    for _ in range(10):
        policy.observe_request("a", 6, 6)
    assert policy.draft_len("a") == 6
    assert policy.acceptance("a") > 0.9


def test_disabled_policy_always_drafts_the_maximum() -> None:
    policy = AdaptivePolicy(5, 0.5, enabled=False)
    _run_steps(policy, 4, 10, plain_rate=100, spec_rate=1)
    assert policy.plan(["a", "b"]) == [5, 5]


@pytest.mark.parametrize("drafts, accepted, expected", [(4, 4, (4.0, 4.0)), (4, 1, (1.0, 2.0)), (3, 0, (0.0, 1.0))])
def test_chain_observations_count_the_first_rejection_only(drafts: int, accepted: int,
                                                           expected: tuple[float, float]) -> None:
    policy = AdaptivePolicy(4, 0.0)
    policy.observe_request("a", drafts, accepted)
    acc = policy.requests["a"]
    assert (acc.accepted, acc.trials) == pytest.approx(expected)


def test_a_bucket_probe_drafts_for_resting_requests_too() -> None:
    policy = AdaptivePolicy(4, 0.1)
    policy.buckets[bucket_of(2)] = BucketStats(spec_rate=80.0, plain_rate=100.0, steps_since_spec=10**6)
    for _ in range(8):  # both requests learn that their drafts fail
        policy.observe_request("a", 1, 0)
        policy.observe_request("b", 1, 0)
    assert policy.plan(["a", "b"]) == [1, 1]  # losing bucket, probe due: each request drafts once
    policy.buckets[bucket_of(2)] = BucketStats(spec_rate=120.0, plain_rate=100.0)
    assert policy.plan(["a", "b"]) == [0, 0]  # winning bucket: these requests rest


def test_near_parity_the_bucket_stays_plain_and_probes_rarely() -> None:
    policy = AdaptivePolicy(4, 0.0)
    modes = _run_steps(policy, 4, 500, plain_rate=100, spec_rate=102)  # 2% faster: within the noise margin
    assert sum(modes) <= 10, sum(modes)


def test_first_probe_drafts_for_a_sample_then_for_all_when_drafts_pay() -> None:
    rids = [f"r{i}" for i in range(32)]
    good = AdaptivePolicy(4, 0.1)
    good.observe_step(32, False, 1.0, 100)  # plain measured: the next step probes
    plan = good.plan(rids)
    assert sum(k > 0 for k in plan) == PROBE_SAMPLE and max(plan) >= 2  # nothing known yet: a sample drafts
    for rid, k in zip(rids, plan):
        good.observe_request(rid, k, k)  # every draft accepted
    assert all(k >= 3 for k in good.plan(rids))  # the others take the sample's acceptance: all draft

    bad = AdaptivePolicy(4, 0.1)
    bad.observe_step(32, False, 1.0, 100)
    plan = bad.plan(rids)
    for rid, k in zip(rids, plan):
        bad.observe_request(rid, k, 0)  # nothing accepted
    again = bad.plan(rids)
    assert sum(k > 0 for k in again) == PROBE_SAMPLE and max(again) == 1  # only another sample, one draft each
    assert all(again[i] for i, k in enumerate(plan) if k == 0 and i < 4 + PROBE_SAMPLE)  # those never verified


def test_rest_after_a_costly_probe_keeps_probing_within_budget() -> None:
    policy = AdaptivePolicy(4, 0.0)
    policy.observe_step(8, False, 1.0, 8)  # a plain step: 1 s for 8 tokens
    policy.observe_step(8, True, 4.0, 8)  # a probe that cost 4 plain steps' time for the same tokens: lost 3
    rest = policy.buckets[bucket_of(8)].rest
    assert rest == min(MAX_REST, round(3 / PROBE_BUDGET))
    cheap = AdaptivePolicy(4, 0.0)
    cheap.observe_step(8, False, 1.0, 8)
    cheap.observe_step(8, True, 1.01, 8)  # lost 1% of a step: the doubling rest alone
    assert cheap.buckets[bucket_of(8)].rest == 2 * MIN_REST
