"""Cache tiers and prefix sharing in routing: a host-tier hit scores below a device hit and above a miss,
and a worker holding a longer device prefix than the chosen one is named to it as a peer."""

from __future__ import annotations

import pytest

from radixmesh.common.errors import RadixMeshError
from radixmesh.protocol import worker_pb2
from radixmesh.router.config import ScoringConfig
from radixmesh.router.peer_hint import plan_peer
from radixmesh.router.policies.scoring import decide
from radixmesh.router.service import name_peer

from .router_factory import BLOCK, make_config, make_registry, make_request, scoring, set_load


def test_host_tier_hit_scores_below_a_device_hit_and_above_a_miss() -> None:
    registry = make_registry(3)
    req = make_request(1, 10)
    cached = {"w0": 10, "w1": 10}  # w0 on its device, w1 in its host tier, w2 nothing
    decision = decide("cache-aware", req, registry.available(), cached, {}, scoring(), {"w0": 10, "w1": 0})
    assert decision.worker.worker_id == "w0" and decision.reason == "cache-hit"
    assert decision.scores["w0"] > decision.scores["w1"] > decision.scores["w2"]
    assert decision.cached_tokens["w1"] == 10 * BLOCK  # held, in either tier
    set_load(registry.get("w0"), num_queued_prefill_tokens=8192, kv_usage=0.9)  # a busy device hit ...
    decision = decide("cache-aware", req, registry.available(), cached, {}, scoring(), {"w0": 10, "w1": 0})
    assert decision.worker.worker_id == "w1"  # ... loses to an idle host hit


def test_partly_offloaded_prefix_counts_its_device_part_in_full() -> None:
    registry = make_registry(2)
    req = make_request(2, 8, tail=0)
    decision = decide("cache-aware", req, registry.available(), {"w0": 8, "w1": 6}, {},
                      scoring(host_hit_weight=0.25), {"w0": 2, "w1": 6})
    assert decision.scores["w0"] == pytest.approx((2 + 0.25 * 6) / 8)
    assert decision.scores["w1"] == pytest.approx(6 / 8)
    assert decision.worker.worker_id == "w1"


def test_host_hit_weight_must_be_strictly_between_zero_and_one() -> None:
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(RadixMeshError, match="host_hit_weight must be in"):
            ScoringConfig(host_hit_weight=bad)


def test_a_longer_device_prefix_elsewhere_is_named_as_a_peer() -> None:
    registry = make_registry(3)
    req = make_request(3, 200)  # 800 tokens + 3
    set_load(registry.get("w0"), num_waiting_reqs=40, num_running_reqs=40)  # w0 holds it but is swamped
    cached = {"w0": 200, "w2": 20}
    decision = decide("cache-aware", req, registry.available(), cached, {}, scoring(), cached)
    assert decision.worker.worker_id != "w0" and decision.reason == "load-imbalance"
    peer = plan_peer(req, decision, registry.available(), cached, {"w0": 7}, min_tokens=512)
    assert peer is not None and peer.worker.worker_id == "w0" and peer.num_tokens == 800 and peer.epoch == 7
    assert plan_peer(req, decision, registry.available(), cached, {}, min_tokens=0) is None  # off
    assert plan_peer(req, decision, registry.available(), cached, {}, min_tokens=900) is None  # not enough more
    host_only = {"w0": 0, "w2": 20}  # w0's copy is in its host tier: not exported
    assert plan_peer(req, decision, registry.available(), host_only, {}, min_tokens=512) is None


def test_the_peer_leaves_the_chosen_worker_at_least_one_token_and_the_request_names_it() -> None:
    registry = make_registry(2)
    req = make_request(4, 300, tail=0)
    set_load(registry.get("w0"), num_waiting_reqs=40, num_running_reqs=40)
    decision = decide("cache-aware", req, registry.available(), {"w0": 300}, {}, scoring(), {"w0": 300})
    decision.peer = plan_peer(req, decision, registry.available(), {"w0": 300}, {"w0": 3}, 512)
    assert decision.peer is not None and decision.peer.num_tokens == 300 * BLOCK - 1
    assert decision.attributes()["routing.peer_worker_id"] == "w0"
    request = worker_pb2.GenerateRequest(request_id="r")
    name_peer(request, decision)
    assert request.peer_prefix.worker_id == "w0" and request.peer_prefix.address == "127.0.0.1:6000"
    assert request.peer_prefix.num_tokens == 1199 and request.peer_prefix.epoch == 3
    decision.peer = None
    name_peer(request, decision)  # a retry elsewhere clears it
    assert not request.HasField("peer_prefix")


def test_router_config_bounds_peer_fetch_min_tokens() -> None:
    with pytest.raises(RadixMeshError, match="peer_fetch_min_tokens"):
        make_config(peer_fetch_min_tokens=-1)
