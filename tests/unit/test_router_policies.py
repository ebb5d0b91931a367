"""Routing policies on fake workers: scores, cache hits, new-prefix spreading, load imbalance."""

from __future__ import annotations

import asyncio
import collections
import time

import pytest

from radixmesh.common.errors import RadixMeshError
from radixmesh.router.policies import POLICY_IDS, create_policy
from radixmesh.router.policies.approx_tree import ApproxPrefixIndex
from radixmesh.router.policies.base import BaseRoutingPolicy, RouteRequest
from radixmesh.router.policies.scoring import decide, is_imbalanced, load_fraction
from tests.unit.router_factory import make_config, make_registry, make_request, scoring, set_load, shared_prefix_request


def route(policy_id: str, requests: list[RouteRequest], num_workers: int = 2) -> list[str]:
    async def run() -> list[str]:
        registry = make_registry(num_workers)
        policy = create_policy(policy_id, make_config(policy=policy_id))
        chosen = []
        for req in requests:
            decision = await policy.choose(req, registry.available())
            await policy.on_routed(req, decision)
            assert set(decision.scores) == {w.worker_id for w in registry.available()}
            chosen.append(decision.worker.worker_id)
        return chosen

    return asyncio.run(run())


def test_registry_has_the_five_policies() -> None:
    assert set(POLICY_IDS) == {"cache-aware", "approx-tree", "power-of-two", "round-robin", "random"}
    with pytest.raises(RadixMeshError, match="unknown policy"):
        create_policy("nope", make_config())
    with pytest.raises(RadixMeshError, match="unknown policy"):
        make_config(policy="least-loaded")


def test_round_robin_cycles() -> None:
    reqs = [make_request(i, 2) for i in range(6)]
    assert route("round-robin", reqs, 3) == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_random_uses_every_worker_and_is_seeded() -> None:
    reqs = [make_request(i, 2) for i in range(40)]
    first = route("random", reqs, 3)
    assert set(first) == {"w0", "w1", "w2"}
    assert route("random", reqs, 3) == first


def test_power_of_two_prefers_the_less_loaded_of_its_pair() -> None:
    async def run() -> collections.Counter[str]:
        registry = make_registry(2)
        w0, _w1 = registry.all()
        set_load(w0, num_running_reqs=10, num_queued_prefill_tokens=4000)
        policy = create_policy("power-of-two", make_config(policy="power-of-two"))
        return collections.Counter([(await policy.choose(make_request(i, 2), registry.available())).worker.worker_id
                                    for i in range(20)])

    assert asyncio.run(run()) == {"w1": 20}


def test_approx_tree_groups_shared_prefixes_and_spreads_new_ones() -> None:
    # 4 groups, 3 prompts each, sent one group member at a time (sequential, interleaved).
    reqs = [shared_prefix_request(g, prefix_blocks=8, suffix=10 * g + i) for i in range(3) for g in range(4)]
    chosen = route("approx-tree", reqs, 2)
    by_group = collections.defaultdict(set)
    for req_index, worker in enumerate(chosen):
        by_group[req_index % 4].add(worker)
    assert all(len(workers) == 1 for workers in by_group.values()), by_group  # each group stays on one worker
    assert collections.Counter(next(iter(w)) for w in by_group.values()) == {"w0": 2, "w1": 2}  # groups spread


def test_cache_aware_without_redis_behaves_as_approx_tree() -> None:
    reqs = [shared_prefix_request(g, prefix_blocks=8, suffix=10 * g + i) for i in range(3) for g in range(4)]
    assert route("cache-aware", reqs, 2) == route("approx-tree", reqs, 2)


class _FlakyRedis:
    """A Redis client whose ping works until `down` is set."""

    def __init__(self) -> None:
        self.down = False
        self.num_pings = 0

    async def ping(self) -> bool:
        self.num_pings += 1
        if self.down:
            raise ConnectionError("connection refused")
        return True


async def _until_active(policy: BaseRoutingPolicy, policy_id: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while policy.active_policy() != policy_id:
        assert time.monotonic() < deadline, f"still {policy.active_policy()}, not {policy_id}"
        await asyncio.sleep(0.05)


def test_cache_aware_notices_redis_gone_without_a_request() -> None:
    """No routing call fails on Redis here: the background ping alone switches to approx-tree."""
    from types import SimpleNamespace

    from radixmesh.router.policies.cache_aware import CacheAwarePolicy

    async def run() -> None:
        redis = _FlakyRedis()
        opened: list[bool] = []

        async def open_inline() -> None:  # the blocking client's connection, opened from a thread
            opened.append(not redis.down)

        async def live_leases(max_age_s: float | None = None) -> dict[str, object]:
            return {}

        reader = SimpleNamespace(redis=redis, config=SimpleNamespace(speculative_ttl_s=3.0), open_inline=open_inline,
                                 live_leases=live_leases)
        policy = CacheAwarePolicy(make_config(policy="cache-aware", redis_probe_s=0.05, sweep_interval_s=0),
                                  reader=reader)
        await policy.start()
        try:
            deadline = time.monotonic() + 10
            while redis.num_pings < 2:  # the background ping, every 0.05 s while Redis is up
                assert time.monotonic() < deadline, "Redis was not pinged in the background"
                await asyncio.sleep(0.05)
            assert policy.active_policy() == "cache-aware"
            assert opened == [True], "the inline connection is opened at start, off the request path"
            redis.down = True
            await _until_active(policy, "approx-tree")
            redis.down = False
            await _until_active(policy, "cache-aware")
            assert opened == [True, True], "Redis is back: the probe reopened the inline connection first"
        finally:
            await policy.close()

    asyncio.run(run())


def test_decide_cache_hit_beats_moderate_load() -> None:
    registry = make_registry(2)
    w0, _w1 = registry.all()
    set_load(w0, num_running_reqs=3, num_queued_prefill_tokens=1000, num_running_decode_tokens=2000, kv_usage=0.3)
    req = make_request(1, 10)
    decision = decide("cache-aware", req, registry.available(), {"w0": 10}, {}, scoring())
    assert decision.worker is w0 and decision.reason == "cache-hit"
    assert decision.cached_tokens == {"w0": 40, "w1": 0}
    assert decision.scores["w0"] > decision.scores["w1"]
    attrs = decision.attributes()
    assert attrs["routing.worker_id"] == "w0" and attrs["routing.candidate.w1.cached_tokens"] == 0
    assert "routing.candidate.w0.score" in attrs


def test_decide_new_prefix_goes_to_least_loaded_then_smallest_footprint() -> None:
    registry = make_registry(3)
    w0, _w1, w2 = registry.all()
    set_load(w0, num_queued_prefill_tokens=500)
    req = make_request(2, 10)
    decision = decide("cache-aware", req, registry.available(), {"w0": 1}, {"w1": 50, "w2": 10}, scoring())
    assert decision.reason == "new-prefix"  # 1 of 10 blocks is below the cache threshold
    assert decision.worker is w2


def test_decide_load_wins_when_badly_imbalanced() -> None:
    registry = make_registry(2)
    w0, w1 = registry.all()
    set_load(w0, num_running_reqs=40, num_waiting_reqs=20)
    set_load(w1, num_running_reqs=2)
    assert is_imbalanced(registry.available(), scoring())
    decision = decide("cache-aware", make_request(3, 10), registry.available(), {"w0": 10}, {}, scoring())
    assert decision.worker is w1 and decision.reason == "load-imbalance"


def test_in_flight_requests_count_before_the_next_poll() -> None:
    registry = make_registry(2)
    w0, _ = registry.all()
    base = load_fraction(w0, scoring())
    w0.begin_request(uncached_tokens=4096)
    assert load_fraction(w0, scoring()) > base
    w0.first_token(4096)
    w0.end_request(4096, first_token_seen=True)
    assert load_fraction(w0, scoring()) == base and w0.num_inflight == 0


def test_ties_are_broken_the_same_way_by_independent_policies() -> None:
    reqs = [make_request(i, 3) for i in range(12)]
    first, second = route("approx-tree", reqs, 3), route("approx-tree", reqs, 3)
    assert first == second and len(set(first)) == 3


def test_approx_index_matches_leading_blocks_and_forgets_lru() -> None:
    index = ApproxPrefixIndex(max_blocks_per_worker=6)
    a = make_request(1, 4).block_hashes
    b = make_request(2, 4).block_hashes
    index.insert("w0", a)
    assert index.match(a, ["w0", "w1"]) == {"w0": 4}
    assert index.match(a[:2] + b[2:], ["w0"]) == {"w0": 2}
    index.insert("w0", b)  # 8 blocks into a set of 6: a's two oldest blocks go
    assert index.match(a, ["w0"]) == {}
    assert index.match(b, ["w0"]) == {"w0": 4}
    assert index.footprint(["w0", "w1"]) == {"w0": 6, "w1": 0}
    index.retain(["w1"])
    assert index.match(b, ["w0"]) == {}


def test_recent_decisions_match_chains_and_expire() -> None:
    from radixmesh.router.policies.cache_aware import RecentDecisions
    from tests.unit.router_factory import FakeClock

    clock = FakeClock()
    recent = RecentDecisions(ttl_s=2.0, clock=clock, max_entries=10)
    a = make_request(1, 4).block_hashes
    recent.record("w0", a)
    assert recent.match(a) == {"w0": 4}
    recent.record("w1", a[2:])  # the latest decision owns blocks 2 and 3; w1 lacks 0 and 1
    assert recent.match(a) == {"w0": 2}
    clock.now = 2.5
    assert recent.match(a) == {}
    for i in range(5):  # 20 blocks into a map of 10: the oldest go
        recent.record("w0", make_request(10 + i, 4).block_hashes)
    assert recent.match(make_request(14, 4).block_hashes) == {"w0": 4}
    assert recent.match(make_request(10, 4).block_hashes) == {}


def test_recent_decisions_keep_keys_a_later_decision_took_over() -> None:
    from radixmesh.router.policies.cache_aware import RecentDecisions
    from tests.unit.router_factory import FakeClock

    clock = FakeClock()
    recent = RecentDecisions(ttl_s=2.0, clock=clock)
    a = make_request(1, 4).block_hashes
    recent.record("w0", a)
    clock.now = 1.5
    recent.record("w1", a)  # the same prefix sent again, to w1: its entries replace w0's
    clock.now = 2.5  # w0's decision expired (and is dropped by the next record); w1's has not
    recent.record("w2", make_request(2, 4).block_hashes)
    assert recent.match(a) == {"w1": 4}
    clock.now = 3.6
    recent.record("w2", make_request(3, 4).block_hashes)
    assert recent.match(a) == {}
    assert len(recent._owner) == 8  # the expired decisions' keys are gone
