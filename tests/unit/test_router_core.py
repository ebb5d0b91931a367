"""Router state machines and dispatch without network: breaker, health, registry, retries."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.router.breaker import CircuitBreaker, CircuitState
from radixmesh.router.config import BreakerConfig, HealthConfig, RetryConfig
from radixmesh.router.discovery.base import WorkerEndpoint
from radixmesh.router.dispatch import RequestRouter
from radixmesh.router.health import HealthState
from radixmesh.router.policies import create_policy
from radixmesh.router.policies.base import RoutingDecision
from radixmesh.router.workers import WorkerHandle
from tests.unit.router_factory import FakeClient, FakeClock, make_config, make_registry, make_request


class TestBreaker:
    def test_opens_after_threshold_and_half_opens_after_timeout(self) -> None:
        clock = FakeClock()
        breaker = CircuitBreaker(BreakerConfig(failure_threshold=3, open_s=5, max_open_s=20), clock)
        breaker.on_failure()
        breaker.on_failure()
        breaker.on_success()  # resets the count
        breaker.on_failure()
        breaker.on_failure()
        assert breaker.state is CircuitState.CLOSED and breaker.can_route()
        breaker.on_failure()
        assert breaker.state is CircuitState.OPEN and not breaker.can_route()
        clock.now = 4.9
        assert not breaker.can_route()
        clock.now = 5.0
        assert breaker.state is CircuitState.HALF_OPEN and breaker.can_route()
        breaker.on_dispatch()
        assert not breaker.can_route(), "only one trial request in half-open state"
        breaker.on_success()
        assert breaker.state is CircuitState.CLOSED and breaker.can_route()

    def test_failed_trial_reopens_for_longer_up_to_the_cap(self) -> None:
        clock = FakeClock()
        breaker = CircuitBreaker(BreakerConfig(failure_threshold=1, open_s=5, max_open_s=12), clock)
        breaker.on_failure()
        opened_for = []
        for _ in range(3):
            start = clock.now
            while breaker.state is CircuitState.OPEN:
                clock.now += 1
            opened_for.append(clock.now - start)
            breaker.on_dispatch()
            breaker.on_failure()
        assert opened_for == [5, 10, 12]


class TestHealth:
    def test_thresholds(self) -> None:
        health = HealthState(HealthConfig(failure_threshold=2, success_threshold=2))
        assert not health.healthy
        assert not health.on_probe(True)
        assert health.on_probe(True) and health.healthy
        assert not health.on_probe(False, "timeout") and health.healthy
        assert not health.on_probe(True)
        assert not health.on_probe(False, "x")
        assert health.on_probe(False, "refused") and not health.healthy
        assert health.last_error == "refused"
        assert not health.on_probe(True) and not health.healthy

    def test_mark_down_is_immediate(self) -> None:
        health = HealthState(HealthConfig())
        health.on_probe(True)
        assert health.mark_down("connection reset") and not health.healthy


class TestRegistry:
    def test_apply_diffs_and_closes_removed_clients(self) -> None:
        registry = make_registry(2)
        w0, w1 = registry.all()
        added: list[str] = []
        registry.on_added.append(lambda h: added.append(h.worker_id))
        moved = WorkerEndpoint("w1", "127.0.0.1:7777")
        asyncio.run(registry.apply([moved, WorkerEndpoint("w2", "127.0.0.1:6002", role="prefill")]))
        assert [w.worker_id for w in registry.all()] == ["w1", "w2"]
        assert isinstance(w0.client, FakeClient) and w0.client.closed
        assert w1.client.closed and registry.get("w1") is not w1  # address changed: a new handle
        assert added == ["w1", "w2"]
        assert registry.available() == [], "new workers wait for a passed probe"
        registry.get("w1").health.on_probe(True)
        registry.get("w2").health.on_probe(True)
        assert [w.worker_id for w in registry.available()] == ["w1"]
        assert [w.worker_id for w in registry.available("prefill")] == ["w2"]

    def test_unchanged_endpoints_keep_their_state(self) -> None:
        registry = make_registry(2)
        w0 = registry.get("w0")
        registry.replace([WorkerEndpoint("w0", "127.0.0.1:6000"), WorkerEndpoint("w1", "127.0.0.1:6001")])
        assert registry.get("w0") is w0 and w0 is not None and w0.health.healthy


Script = dict[str, list[object]]


def scripted_stream(script: Script, calls: list[str]) -> object:
    """open_stream whose per-worker behaviour is a list: items to yield, or an error to raise."""

    async def open_stream(worker: WorkerHandle, decision: RoutingDecision, attempt: int) -> AsyncIterator[str]:
        calls.append(worker.worker_id)
        for item in script[worker.worker_id]:
            await asyncio.sleep(0)
            if isinstance(item, RadixMeshError):
                raise item
            yield f"{worker.worker_id}:{item}"

    return open_stream


def make_router(num_workers: int = 3, max_attempts: int = 3) -> tuple[RequestRouter, list[float]]:
    import dataclasses

    config = dataclasses.replace(make_config(policy="round-robin"),
                                 retry=RetryConfig(max_attempts=max_attempts, base_backoff_s=0.1, max_backoff_s=0.3))
    sleeps: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)

    router = RequestRouter(config, make_registry(num_workers), create_policy("round-robin", config),
                           sleep=fake_sleep, rng=lambda: 1.0)
    return router, sleeps


def collect(router: RequestRouter, script: Script, calls: list[str]) -> list[str]:
    async def run() -> list[str]:
        return [item async for item in router.stream(make_request(1, 2), scripted_stream(script, calls))]

    return asyncio.run(run())


def unavailable(msg: str = "connection refused") -> RadixMeshError:
    return RadixMeshError(ErrorCode.UNAVAILABLE, msg)


class TestDispatch:
    def test_retries_elsewhere_before_the_first_message_with_backoff(self) -> None:
        router, sleeps = make_router()
        calls: list[str] = []
        out = collect(router, {"w0": [unavailable()], "w2": [unavailable()], "w1": ["a", "b"]}, calls)
        assert out == ["w1:a", "w1:b"] and calls == ["w0", "w2", "w1"]  # round-robin over the untried ones
        assert sleeps == [0.1, 0.2]  # base * 2^(attempt-1), times the jitter draw (1.0 here)
        w0 = router.registry.get("w0")
        assert w0 is not None and not w0.health.healthy, "an unreachable worker is marked down at once"
        assert all(w.num_inflight == 0 and w.inflight_prefill_tokens == 0 for w in router.registry.all())
        assert router.inflight == {}

    def test_no_retry_after_the_first_message(self) -> None:
        router, _ = make_router()
        calls: list[str] = []
        with pytest.raises(RadixMeshError, match="worker w0 failed mid-stream: gone") as info:
            collect(router, {"w0": ["a", unavailable("gone")], "w1": ["x"], "w2": ["y"]}, calls)
        assert info.value.code is ErrorCode.UNAVAILABLE and calls == ["w0"]

    def test_bad_requests_are_not_retried_and_do_not_trip_the_breaker(self) -> None:
        router, _ = make_router()
        calls: list[str] = []
        bad = RadixMeshError(ErrorCode.INVALID_ARGUMENT, "max_new_tokens too large", "max_new_tokens")
        with pytest.raises(RadixMeshError, match="too large"):
            collect(router, {"w0": [bad], "w1": [], "w2": []}, calls)
        w0 = router.registry.get("w0")
        assert calls == ["w0"] and w0 is not None and w0.breaker.state is CircuitState.CLOSED and w0.health.healthy

    def test_gives_up_after_max_attempts_with_the_last_error(self) -> None:
        router, sleeps = make_router(num_workers=3, max_attempts=2)
        calls: list[str] = []
        with pytest.raises(RadixMeshError, match="refused-2"):
            collect(router, {"w0": [unavailable("refused-1")], "w2": [unavailable("refused-2")], "w1": ["ok"]}, calls)
        assert calls == ["w0", "w2"] and len(sleeps) == 1

    def test_runs_out_of_workers_with_the_last_worker_error(self) -> None:
        router, _ = make_router(num_workers=2, max_attempts=5)
        calls: list[str] = []
        with pytest.raises(RadixMeshError, match="refused-b"):
            collect(router, {"w0": [unavailable("refused-a")], "w1": [unavailable("refused-b")]}, calls)
        assert calls == ["w0", "w1"]

    def test_no_worker_at_all(self) -> None:
        router, sleeps = make_router(num_workers=0)
        with pytest.raises(RadixMeshError, match="no worker available") as info:
            collect(router, {}, [])
        assert info.value.code is ErrorCode.UNAVAILABLE
        assert sum(sleeps) == pytest.approx(router.config.retry.wait_for_worker_s)  # waited for one, then failed

    def test_a_request_waits_for_a_worker_that_comes_back(self) -> None:
        router, sleeps = make_router(num_workers=2)
        for worker in router.registry.all():
            worker.health.mark_down("probe timed out")  # every worker blipped at once
        w1 = router.registry.get("w1")
        assert w1 is not None

        async def probe_passes_later(seconds: float) -> None:
            sleeps.append(seconds)
            if len(sleeps) == 3:
                w1.health.on_probe(True)

        router.sleep = probe_passes_later
        calls: list[str] = []
        assert collect(router, {"w1": ["a", "b"]}, calls) == ["w1:a", "w1:b"]
        assert calls == ["w1"] and len(sleeps) == 3

    def test_no_wait_when_configured_off(self) -> None:
        import dataclasses

        router, sleeps = make_router(num_workers=1)
        router.config = dataclasses.replace(router.config, retry=dataclasses.replace(router.config.retry,
                                                                                     wait_for_worker_s=0.0))
        router.registry.all()[0].health.mark_down("gone")
        with pytest.raises(RadixMeshError, match="1 known, none healthy"):
            collect(router, {}, [])
        assert sleeps == []

    def test_breaker_keeps_a_failing_worker_out(self) -> None:
        router, _ = make_router(num_workers=2)
        w0 = router.registry.get("w0")
        assert w0 is not None
        internal = RadixMeshError(ErrorCode.INTERNAL, "boom")
        for _ in range(2):  # INTERNAL does not mark it down, but counts for the breaker
            calls: list[str] = []
            script: Script = {"w0": [internal], "w1": ["ok"]}
            collect(router, script, calls)
            router.policy._next = 0  # round-robin: start at w0 again
        assert w0.health.healthy and w0.breaker.state is CircuitState.OPEN
        calls = []
        assert collect(router, {"w0": ["never"], "w1": ["ok"]}, calls) == ["w1:ok"] and calls == ["w1"]

    def test_closing_the_stream_early_is_not_a_failure(self) -> None:
        router, _ = make_router()

        async def run() -> None:
            calls: list[str] = []
            stream = router.stream(make_request(1, 2), scripted_stream({"w0": ["a", "b", "c"]}, calls))
            assert await stream.__anext__() == "w0:a"
            await stream.aclose()

        asyncio.run(run())
        w0 = router.registry.get("w0")
        assert w0 is not None and w0.num_inflight == 0 and w0.breaker.state is CircuitState.CLOSED


def draining(msg: str = "worker is draining") -> RadixMeshError:
    return RadixMeshError(ErrorCode.DRAINING, msg)


def collect_resumable(router: RequestRouter, script: Script, calls: list[str], resumable: bool = True) -> list[str]:
    async def run() -> list[str]:
        stream = router.stream(make_request(1, 2), scripted_stream(script, calls), resumable=lambda: resumable)
        return [item async for item in stream]

    return asyncio.run(run())


class TestMigration:
    def test_a_break_after_the_first_item_continues_on_another_worker_at_once(self) -> None:
        router, sleeps = make_router()
        calls: list[str] = []
        out = collect_resumable(router, {"w0": ["a", unavailable("gone")], "w2": ["b", "c"], "w1": []}, calls)
        assert out == ["w0:a", "w2:b", "w2:c"] and calls == ["w0", "w2"] and sleeps == []  # (round-robin order)
        assert router.num_migrations == 1

    def test_not_resumable_or_off_or_past_the_limit_ends_with_the_error(self) -> None:
        import dataclasses

        from radixmesh.router.config import MigrationConfig

        router, _ = make_router()
        with pytest.raises(RadixMeshError, match="failed mid-stream"):
            collect_resumable(router, {"w0": ["a", unavailable()], "w2": ["b"], "w1": []}, [], resumable=False)
        router, _ = make_router()
        router.config = dataclasses.replace(router.config, migration=MigrationConfig(max_per_request=1))
        calls: list[str] = []
        with pytest.raises(RadixMeshError, match="after 1 migrations"):
            collect_resumable(router, {"w0": ["a", unavailable()], "w2": ["b", unavailable()], "w1": ["c"]}, calls)
        assert calls == ["w0", "w2"]

    def test_a_drain_refusal_is_retried_at_once_without_a_breaker_failure(self) -> None:
        router, sleeps = make_router()
        calls: list[str] = []
        assert collect_resumable(router, {"w0": [draining()], "w2": ["a"], "w1": []}, calls) == ["w2:a"]
        w0 = router.registry.get("w0")
        assert w0 is not None and sleeps == [] and not w0.health.healthy and w0.breaker._failures == 0

    def test_a_half_open_trial_that_ends_without_a_verdict_lets_the_next_one_through(self) -> None:
        """A trial request refused by a draining worker (or whose caller left) before its first item must not keep
        the circuit shut for good."""
        router, _ = make_router(num_workers=2)
        w0 = router.registry.get("w0")
        assert w0 is not None
        clock = FakeClock()
        w0.breaker.clock = clock
        for _ in range(router.config.breaker.failure_threshold):
            w0.breaker.on_failure()
        clock.now = router.config.breaker.open_s
        assert w0.breaker.state is CircuitState.HALF_OPEN and w0.is_available
        assert collect_resumable(router, {"w0": [draining()], "w1": ["b"]}, []) == ["w1:b"]
        w0.health.on_probe(True)  # healthy again after its restart
        assert w0.breaker.state is CircuitState.HALF_OPEN and w0.is_available, "the trial is free again"

    def test_a_half_open_trial_passes_with_its_first_item(self) -> None:
        """A long stream as the trial must not keep the worker out of routing (and of migrations) until it ends."""
        router, _ = make_router(num_workers=2)
        w0 = router.registry.get("w0")
        assert w0 is not None
        clock = FakeClock()
        w0.breaker.clock = clock
        for _ in range(router.config.breaker.failure_threshold):
            w0.breaker.on_failure()
        clock.now = router.config.breaker.open_s

        async def run() -> None:
            stream = router.stream(make_request(1, 2), scripted_stream({"w0": ["a", "b"]}, []))
            assert await stream.__anext__() == "w0:a"
            assert w0.breaker.state is CircuitState.CLOSED and w0.is_available, "closed while the trial streams"
            await stream.aclose()

        asyncio.run(run())
