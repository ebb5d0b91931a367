"""Disaggregated routing: decode workers take whole requests, prefill workers are named to them by
cache and queued prefill work, short prompts skip the prefill tier; roles come from the probes."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest

from radixmesh.protocol import worker_pb2
from radixmesh.router.config import DisaggConfig, RouterConfig
from radixmesh.router.discovery.base import WorkerEndpoint
from radixmesh.router.dispatch import RequestRouter
from radixmesh.router.health_checker import HealthChecker
from radixmesh.router.policies import create_policy
from radixmesh.router.policies.base import RouteRequest, RoutingDecision
from radixmesh.router.service import name_prefill_worker, routing_info
from radixmesh.router.worker_client import ProbeResult
from radixmesh.router.workers import WorkerHandle, WorkerRegistry

from .router_factory import BLOCK, FakeClient, make_config, make_request, set_load


def make_pd_router(roles: dict[str, str], policy: str = "approx-tree", min_prefill_tokens: int = 8,
                   ) -> tuple[RequestRouter, RouterConfig]:
    config = dataclasses.replace(make_config(policy=policy), disagg=DisaggConfig(min_prefill_tokens=min_prefill_tokens))
    registry = WorkerRegistry(config.health, config.breaker, FakeClient)
    registry.replace([WorkerEndpoint(worker_id, f"127.0.0.1:{7000 + i}", role)
                      for i, (worker_id, role) in enumerate(roles.items())])
    for worker in registry.all():
        worker.health.on_probe(True)
        set_load(worker)
    router = RequestRouter(config, registry, create_policy(policy, config),
                           prefill_policy=create_policy(policy, config))
    return router, config


def route(router: RequestRouter, request: RouteRequest) -> RoutingDecision:
    """Route `request` through the router's stream (so its bookkeeping runs) and return the decision."""
    decisions: list[RoutingDecision] = []

    async def open_stream(worker: WorkerHandle, decision: RoutingDecision, attempt: int) -> AsyncIterator[str]:
        yield worker.worker_id

    async def run() -> None:
        async for _ in router.stream(request, open_stream, lambda d, a: decisions.append(d)):
            pass

    asyncio.run(run())
    return decisions[-1]


def test_decode_worker_gets_a_prefill_worker_and_prefill_workers_take_no_generate() -> None:
    router, _ = make_pd_router({"d0": "decode", "p0": "prefill", "p1": "prefill"})
    decision = route(router, make_request(1, 8))
    assert decision.worker.worker_id == "d0" and decision.pd_reason == "prefill-tier"
    assert decision.prefill is not None and decision.prefill.worker.worker_id in ("p0", "p1")
    attrs = decision.attributes()
    assert attrs["routing.prefill_worker_id"] == decision.prefill.worker.worker_id
    assert attrs["routing.pd_reason"] == "prefill-tier"
    assert all(w.num_inflight == 0 and w.inflight_prefill_tokens == 0 for w in router.registry.all())


def test_prefill_worker_follows_its_cache_and_new_prefixes_spread_by_queued_prefill_tokens() -> None:
    router, _ = make_pd_router({"d0": "decode", "p0": "prefill", "p1": "prefill"})
    first = route(router, make_request(1, 8)).prefill
    assert first is not None
    again = route(router, make_request(1, 8, tail=20)).prefill  # same prefix, longer prompt
    assert again is not None and again.worker is first.worker and again.reason == "cache-hit"
    busy, idle = first.worker, next(w for w in router.registry.available("prefill") if w is not first.worker)
    set_load(busy, num_queued_prefill_tokens=6000)
    fresh = route(router, make_request(2, 8)).prefill
    assert fresh is not None and fresh.worker is idle and fresh.reason == "new-prefix"


def test_few_uncached_tokens_skip_the_prefill_tier() -> None:
    router, _ = make_pd_router({"d0": "decode", "p0": "prefill"}, min_prefill_tokens=3 * BLOCK)
    assert route(router, make_request(1, 2)).pd_reason == "short-prompt"  # 2 blocks + 3 tokens: too few
    long = route(router, make_request(1, 8))
    assert long.pd_reason == "prefill-tier"
    # the decode worker now holds the 8 blocks (approx-tree): the next turn adds 2 blocks, under the threshold
    follow_up = route(router, make_request(1, 10))
    assert follow_up.pd_reason == "short-prompt" and follow_up.prefill is None
    assert follow_up.cached_tokens["d0"] == 8 * BLOCK


def test_without_an_available_prefill_worker_decode_computes_the_prompt() -> None:
    router, _ = make_pd_router({"d0": "decode", "p0": "prefill"})
    p0 = router.registry.get("p0")
    assert p0 is not None
    p0.health.mark_down("gone")
    decision = route(router, make_request(1, 8))
    assert (decision.worker.worker_id, decision.pd_reason, decision.prefill) == ("d0", "no-prefill-worker", None)


def test_unified_workers_never_get_a_prefill_worker() -> None:
    router, _ = make_pd_router({"u0": "unified", "p0": "prefill"})
    decision = route(router, make_request(1, 8))
    assert decision.worker.worker_id == "u0" and decision.prefill is None and decision.pd_reason == ""


def test_prefill_worker_counts_in_flight_work_until_the_first_message() -> None:
    router, _ = make_pd_router({"d0": "decode", "p0": "prefill"}, policy="round-robin")
    p0 = router.registry.get("p0")
    assert p0 is not None
    seen: list[tuple[int, int]] = []

    async def open_stream(worker: WorkerHandle, decision: RoutingDecision, attempt: int) -> AsyncIterator[str]:
        seen.append((p0.num_inflight, p0.inflight_prefill_tokens))
        yield "first"
        seen.append((p0.num_inflight, p0.inflight_prefill_tokens))
        yield "second"

    async def run() -> list[str]:
        return [item async for item in router.stream(make_request(1, 4), open_stream)]

    assert asyncio.run(run()) == ["first", "second"]
    assert seen == [(1, 4 * BLOCK + 3), (0, 0)]
    assert p0.num_inflight == 0


def test_routing_info_and_request_name_the_prefill_worker() -> None:
    router, _ = make_pd_router({"d0": "decode", "p0": "prefill"})
    decision = route(router, make_request(1, 8))
    info = routing_info(decision, 1)
    assert (info.prefill_worker_id, info.prefill_worker_address, info.pd_reason) == (
        "p0", "127.0.0.1:7001", "prefill-tier")
    request = worker_pb2.GenerateRequest(token_ids=[1, 2, 3])
    name_prefill_worker(request, decision)
    assert (request.prefill.worker_id, request.prefill.address) == ("p0", "127.0.0.1:7001")
    decision.prefill = None  # a retry on a decision without one clears it
    name_prefill_worker(request, decision)
    assert not request.HasField("prefill")


class RoleProbe(FakeClient):
    def __init__(self, endpoint: WorkerEndpoint) -> None:
        super().__init__(endpoint)
        self.role = "decode"

    async def probe(self, timeout_s: float) -> ProbeResult:
        return ProbeResult(True, worker_id=self.endpoint.worker_id, role=self.role)


def test_roles_come_from_the_probes_when_discovery_does_not_know_them() -> None:
    config = make_config()
    registry = WorkerRegistry(config.health, config.breaker, RoleProbe)
    registry.replace([WorkerEndpoint("127.0.0.1:1", "127.0.0.1:1"), WorkerEndpoint("127.0.0.1:2", "127.0.0.1:2")])
    prefill = registry.get("127.0.0.1:2")
    assert prefill is not None
    prefill.client.role = "prefill"

    async def run() -> None:
        checker = HealthChecker(registry, config.health)
        for worker in registry.all():
            await checker.check_once(worker)

    asyncio.run(run())
    assert [w.worker_id for w in registry.available("decode")] == ["127.0.0.1:1"]
    assert [w.worker_id for w in registry.available("prefill")] == ["127.0.0.1:2"]
    assert registry.available() == []  # no unified worker left


def test_pd_config_is_checked() -> None:
    with pytest.raises(Exception, match="min_prefill_tokens"):
        DisaggConfig(min_prefill_tokens=-1)
