"""LoRA adapter affinity in the router: requests of an adapter go to the workers holding it (4 adapters over 2
workers: every request lands where its adapter is, against about half by random routing), an adapter no worker
holds is loaded on the least loaded one (once, for concurrent requests), a hot adapter spreads, and one the router
cannot place is NOT_FOUND naming it."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.router.config import AdapterConfig
from radixmesh.router.dispatch import RequestRouter
from radixmesh.router.policies import create_policy
from radixmesh.router.workers import WorkerHandle

from .router_factory import make_config, make_registry, make_request, set_load


class LoadingClient:
    """Records LoadLoraAdapter calls (after a short wait, as a real load takes)."""

    def __init__(self) -> None:
        self.loads: list[tuple[str, str]] = []

    async def load_lora_adapter(self, name: str, path: str) -> None:
        await asyncio.sleep(0.01)
        self.loads.append((name, path))


def _router(policy: str, paths: tuple[tuple[str, str], ...] = ()) -> tuple[RequestRouter, list[WorkerHandle]]:
    config = dataclasses.replace(make_config(), adapters=AdapterConfig(paths))
    registry = make_registry(2)
    workers = sorted(registry.all(), key=lambda w: w.worker_id)
    for worker, held in zip(workers, (("a0", "a1"), ("a2", "a3"))):
        set_load(worker, lora_adapters=tuple((n, 0, 0) for n in held), max_loras_per_batch=4)
        worker.client = LoadingClient()
    return RequestRouter(config, registry, create_policy(policy, config)), workers


def _hit_rate(policy: str, affinity: bool, num: int = 200) -> float:
    router, _ = _router(policy)
    holder = {"a0": "w0", "a1": "w0", "a2": "w1", "a3": "w1"}
    rng = random.Random(3)
    hits = 0
    for i in range(num):
        adapter = f"a{rng.randrange(4)}"
        request = dataclasses.replace(make_request(rng.randrange(50), 3, rid=f"r{i}"),
                                      lora_name=adapter if affinity else "")
        decision = asyncio.run(router.select(request))
        hits += decision.worker.worker_id == holder[adapter]
    return hits / num


@pytest.mark.parametrize("policy", ["cache-aware", "round-robin", "random"])
def test_requests_land_where_their_adapter_is(policy: str) -> None:
    assert _hit_rate(policy, affinity=True) == 1.0
    assert 0.3 < _hit_rate("random", affinity=False) < 0.7  # what routing blind to adapters gets


def test_unplaced_adapter_is_loaded_on_the_least_loaded_worker_once() -> None:
    router, workers = _router("cache-aware", (("new", "/adapters/new"),))
    set_load(workers[0], num_running_reqs=9, lora_adapters=(("a0", 9, 0),), max_loras_per_batch=4)

    async def burst() -> list[str]:
        requests = [dataclasses.replace(make_request(i, 2, rid=f"n{i}"), lora_name="new") for i in range(5)]
        return [(await d).worker.worker_id for d in [router.select(r) for r in requests]]

    async def concurrent() -> list[str]:
        requests = [dataclasses.replace(make_request(i, 2, rid=f"n{i}"), lora_name="new") for i in range(5)]
        decisions = await asyncio.gather(*(router.select(r) for r in requests))
        return [d.worker.worker_id for d in decisions]

    assert set(asyncio.run(concurrent())) == {"w1"}
    assert workers[1].client.loads == [("new", "/adapters/new")] and workers[0].client.loads == []
    assert set(asyncio.run(burst())) == {"w1"}


def test_hot_adapter_spreads_and_unknown_adapter_is_not_found() -> None:
    router, workers = _router("cache-aware", (("a0", "/adapters/a0"),))
    set_load(workers[0], num_running_reqs=30, lora_adapters=(("a0", 30, 0), ("a1", 0, 0)), max_loras_per_batch=4)
    request = dataclasses.replace(make_request(1, 2), lora_name="a0")
    assert asyncio.run(router.select(request)).worker.worker_id == "w1"
    assert workers[1].client.loads == [("a0", "/adapters/a0")]
    with pytest.raises(RadixMeshError) as err:
        asyncio.run(router.select(dataclasses.replace(request, lora_name="ghost")))
    assert err.value.code is ErrorCode.NOT_FOUND and "'ghost'" in err.value.message
