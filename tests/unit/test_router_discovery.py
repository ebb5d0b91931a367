"""Static worker lists and the health checker's use of probes (no network)."""

from __future__ import annotations

import asyncio

import pytest

from radixmesh.common.errors import RadixMeshError
from radixmesh.router.config import HealthConfig
from radixmesh.router.discovery.base import WorkerEndpoint
from radixmesh.router.discovery.static import StaticDiscovery, parse_workers
from radixmesh.router.health_checker import HealthChecker
from radixmesh.router.worker_client import ProbeResult
from radixmesh.router.workers import WorkerRegistry
from radixmesh.wire.load import WorkerLoad
from tests.unit.router_factory import make_config


def test_parse_workers() -> None:
    assert parse_workers("127.0.0.1:1, host-b:50051,") == [WorkerEndpoint("127.0.0.1:1", "127.0.0.1:1"),
                                                           WorkerEndpoint("host-b:50051", "host-b:50051")]
    for bad in ("", "nohost", "h:0", "h:99999", "h:x", "a:1,a:1"):
        with pytest.raises(RadixMeshError):
            parse_workers(bad)


def test_static_discovery_reports_once_and_stops() -> None:
    async def run() -> list[list[WorkerEndpoint]]:
        seen: list[list[WorkerEndpoint]] = []
        discovery = StaticDiscovery(parse_workers("a:1,b:2"))
        task = asyncio.create_task(discovery.run(seen.append))
        await asyncio.sleep(0.01)
        await discovery.stop()
        await asyncio.wait_for(task, 1)
        return seen

    assert [[e.worker_id for e in s] for s in asyncio.run(run())] == [["a:1", "b:2"]]


class ScriptedProbe:
    def __init__(self, endpoint: WorkerEndpoint) -> None:
        self.results: list[ProbeResult] = []
        self.calls = 0

    async def probe(self, timeout_s: float) -> ProbeResult:
        self.calls += 1
        if self.results:
            return self.results.pop(0)
        await asyncio.sleep(10)  # no script left: a probe that hangs
        raise AssertionError("unreachable")


def test_health_checker_applies_probes_with_thresholds() -> None:
    async def run() -> None:
        config = HealthConfig(interval_s=0.01, timeout_s=0.02, failure_threshold=2, success_threshold=1)
        registry = WorkerRegistry(config, make_config().breaker, ScriptedProbe)
        checker = HealthChecker(registry, config)
        await registry.apply([WorkerEndpoint("w0", "h:1")])
        handle = registry.get("w0")
        assert handle is not None
        load = WorkerLoad(num_running_reqs=3, max_total_tokens=100)
        handle.client.results = [ProbeResult(True, load=load, worker_id="pod-0"), ProbeResult(False, "refused"),
                                 ProbeResult(True, "GetLoad: DEADLINE_EXCEEDED")]
        await checker.check_once(handle)
        assert handle.health.healthy and handle.load == load and handle.index_id == "pod-0"
        await checker.check_once(handle)
        assert handle.health.healthy, "one failure is below the threshold"
        await checker.check_once(handle)
        assert handle.health.healthy and handle.load == load, "a late GetLoad keeps the last load"
        await checker.check_once(handle)  # hangs: times out
        await checker.check_once(handle)
        assert not handle.health.healthy and handle.health.last_error == "probe timed out"
        await registry.apply([])  # removed: its probing task ends
        await asyncio.sleep(0.1)
        await checker.close()

    asyncio.run(run())
