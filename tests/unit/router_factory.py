"""Small factories for router tests: workers, registries and requests without any network."""

from __future__ import annotations

import dataclasses
from typing import Any

from radixmesh.router.config import BreakerConfig, HealthConfig, RouterConfig, ScoringConfig
from radixmesh.router.discovery.base import WorkerEndpoint
from radixmesh.router.policies.base import RouteRequest
from radixmesh.router.workers import WorkerHandle, WorkerRegistry
from radixmesh.wire.block_hash import block_hashes
from radixmesh.wire.load import WorkerLoad

BLOCK = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeClient:
    def __init__(self, endpoint: WorkerEndpoint) -> None:
        self.endpoint = endpoint
        self.closed = False

    def close(self) -> None:
        self.closed = True


def make_config(**overrides: Any) -> RouterConfig:
    base = RouterConfig(block_size=BLOCK, seed=7, health=HealthConfig(failure_threshold=2, success_threshold=1),
                        breaker=BreakerConfig(failure_threshold=2, open_s=5.0, max_open_s=20.0))
    return dataclasses.replace(base, **overrides)


def make_registry(num_workers: int = 2, healthy: bool = True, clock: FakeClock | None = None) -> WorkerRegistry:
    config = make_config()
    registry = WorkerRegistry(config.health, config.breaker, FakeClient, clock)
    endpoints = [WorkerEndpoint(f"w{i}", f"127.0.0.1:{6000 + i}") for i in range(num_workers)]
    registry.replace(endpoints)
    if healthy:
        for worker in registry.all():
            worker.health.on_probe(True)
    return registry


def set_load(worker: WorkerHandle, **fields: Any) -> None:
    worker.load = WorkerLoad(**{"max_total_tokens": 10_000, **fields})


def make_request(prefix: int, num_blocks: int, tail: int = 3, rid: str = "r") -> RouteRequest:
    """A prompt of `num_blocks` full blocks determined by `prefix`, plus `tail` loose tokens."""
    ids = [prefix * 10_000 + i for i in range(num_blocks * BLOCK)] + [1] * tail
    return RouteRequest(rid, len(ids), tuple(block_hashes(ids, BLOCK)), BLOCK)


def shared_prefix_request(group: int, prefix_blocks: int, suffix: int, rid: str = "r") -> RouteRequest:
    """Prompts of one group share `prefix_blocks` blocks, then differ by `suffix` for 2 blocks."""
    ids = [group * 10_000 + i for i in range(prefix_blocks * BLOCK)]
    ids += [suffix * 7 + 900_000 + i for i in range(2 * BLOCK)]
    return RouteRequest(rid, len(ids), tuple(block_hashes(ids, BLOCK)), BLOCK)


def scoring(**overrides: Any) -> ScoringConfig:
    return dataclasses.replace(ScoringConfig(), **overrides)
