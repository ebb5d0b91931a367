"""Kubernetes discovery against a list/watch API served on 127.0.0.1, through the real client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from radixmesh.router.discovery.base import WorkerEndpoint
from radixmesh.router.discovery.kubernetes import KubernetesDiscovery, KubernetesDiscoveryConfig
from radixmesh.router.discovery.loopback_map import PodLoopbackMap

from .fake_kube_api import FakeKubeApi, make_pod

pytestmark = pytest.mark.integration

SELECTOR = "app.kubernetes.io/component=worker,app.kubernetes.io/instance=rm"


@dataclass
class Harness:
    api: FakeKubeApi
    discovery: KubernetesDiscovery
    changes: list[list[WorkerEndpoint]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    fail_on_change: int = 0
    """Raise from on_change this many times (a router bug or a full queue) before accepting."""

    def on_change(self, workers: list[WorkerEndpoint]) -> None:
        if self.fail_on_change > 0:
            self.fail_on_change -= 1
            raise RuntimeError("on_change failed")
        self.changes.append(workers)
        self.changed.set()

    @property
    def current(self) -> dict[str, WorkerEndpoint]:
        return {w.worker_id: w for w in self.changes[-1]} if self.changes else {}

    async def wait_for(self, predicate: Callable[[dict[str, WorkerEndpoint]], bool], timeout_s: float = 10.0) -> None:
        async def _until() -> None:
            while not (self.changes and predicate(self.current)):
                self.changed.clear()
                await self.changed.wait()

        try:
            await asyncio.wait_for(_until(), timeout_s)
        except asyncio.TimeoutError:
            raise AssertionError(f"discovery never reached the expected set; last: {sorted(self.current)}") from None

    async def wait_requests(self, count: int, timeout_s: float = 10.0) -> None:
        async def _until() -> None:
            while len(self.api.requests) < count:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(_until(), timeout_s)


@contextlib.asynccontextmanager
async def running(pods: list[dict] | None = None, fail_first: int = 0, fail_on_change: int = 0,
                  loopback: PodLoopbackMap | None = None) -> AsyncIterator[Harness]:
    from kubernetes.aio import client

    api = FakeKubeApi(fail_next=fail_first)
    host = await api.start()
    for pod in pods or []:
        await api.put(pod)

    async def client_factory() -> client.ApiClient:
        return client.ApiClient(client.Configuration(host=host))

    config = KubernetesDiscoveryConfig(selector=SELECTOR, namespace=api.namespace, backoff_initial_s=0.05,
                                       backoff_max_s=0.2, loopback=loopback)
    harness = Harness(api, KubernetesDiscovery(config, client_factory), fail_on_change=fail_on_change)
    task = asyncio.ensure_future(harness.discovery.run(harness.on_change))
    try:
        yield harness
    finally:
        await harness.discovery.stop()
        await asyncio.wait_for(task, 5.0)  # run() returns promptly after stop(), without errors
        await api.close()


def test_initial_list_reports_ready_pods_with_role_and_port() -> None:
    async def scenario() -> None:
        pods = [
            make_pod("w-unified", ip="10.0.0.1"),
            make_pod("w-prefill", role="prefill", ip="10.0.0.2", grpc_port=6000),
            make_pod("w-decode", role="decode", ip="fd00::7", grpc_port=None),
            make_pod("w-starting", ready=False, ip="10.0.0.4"),
            make_pod("w-pending", ip=None, phase="Pending"),
            make_pod("w-bad-role", role="draft", ip="10.0.0.6"),
            make_pod("w-other-release", instance="other", ip="10.0.0.5"),
        ]
        async with running(pods) as h:
            await h.wait_for(lambda ws: len(ws) > 0)
            assert h.current == {
                "w-unified": WorkerEndpoint("w-unified", "10.0.0.1:50051", "unified"),
                "w-prefill": WorkerEndpoint("w-prefill", "10.0.0.2:6000", "prefill"),
                "w-decode": WorkerEndpoint("w-decode", "[fd00::7]:50051", "decode"),
            }
            assert h.current["w-prefill"].labels["radixmesh.io/role"] == "prefill"
            assert h.api.requests[0].label_selector == SELECTOR
            assert len(h.changes) == 1, "the initial set is reported once"

    asyncio.run(scenario())


def test_pod_added_when_ready_and_removed_when_not_ready_or_deleted() -> None:
    async def scenario() -> None:
        async with running([make_pod("w0", ip="10.0.0.1")]) as h:
            await h.wait_for(lambda ws: set(ws) == {"w0"})
            await h.wait_requests(2)  # list + watch

            await h.api.put(make_pod("w1", ready=False, ip="10.0.0.2"))  # created, model still loading
            await h.api.put(make_pod("w1", ready=True, ip="10.0.0.2"))
            await h.wait_for(lambda ws: set(ws) == {"w0", "w1"})
            reported = [sorted(w.worker_id for w in change) for change in h.changes]
            assert reported == [["w0"], ["w0", "w1"]], "a pod that is not Ready is not reported"

            await h.api.put(make_pod("w0", ready=False, ip="10.0.0.1"))  # readiness probe failing
            await h.wait_for(lambda ws: set(ws) == {"w1"})

            terminating = make_pod("w1", ip="10.0.0.2")
            terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
            await h.api.put(terminating)  # still Ready, but being deleted
            await h.wait_for(lambda ws: ws == {})

            await h.api.put(make_pod("w0", ready=True, ip="10.0.0.9"))  # back, with a new IP
            await h.wait_for(lambda ws: set(ws) == {"w0"} and ws["w0"].address == "10.0.0.9:50051")
            await h.api.delete("w0")
            await h.wait_for(lambda ws: ws == {})
            assert h.discovery.num_lists == 1

    asyncio.run(scenario())


def test_watch_resumes_from_last_resource_version_after_expiry() -> None:
    async def scenario() -> None:
        async with running([make_pod("w0")]) as h:
            await h.wait_for(lambda ws: set(ws) == {"w0"})
            await h.wait_requests(2)
            rv_seen = await h.api.put(make_pod("w1", ip="10.0.0.2"))
            await h.wait_for(lambda ws: set(ws) == {"w0", "w1"})
            num_changes = len(h.changes)

            await h.api.expire_watches()  # the API server ends the stream
            await h.wait_requests(3)
            await h.api.put(make_pod("w2", ip="10.0.0.3"))
            await h.wait_for(lambda ws: set(ws) == {"w0", "w1", "w2"})

            resumed = h.api.requests[2]
            assert resumed.watch and resumed.resource_version == rv_seen, h.api.requests
            assert h.discovery.num_lists == 1, "an expired watch resumes without listing again"
            assert len(h.changes) == num_changes + 1, "no event was replayed"

    asyncio.run(scenario())


def test_relist_after_410_gone_replaces_the_state() -> None:
    async def scenario() -> None:
        async with running([make_pod("w0"), make_pod("w1", ip="10.0.0.2")]) as h:
            await h.wait_for(lambda ws: set(ws) == {"w0", "w1"})
            await h.wait_requests(2)
            # While the router is disconnected: w1 goes away, w2 arrives, and history is compacted.
            h.api.fail_next = 1
            await h.api.expire_watches()
            await h.wait_requests(3)  # the failed attempt
            await h.api.delete("w1")
            await h.api.put(make_pod("w2", role="decode", ip="10.0.0.3"))
            h.api.compact()

            await h.wait_for(lambda ws: set(ws) == {"w0", "w2"})
            assert h.discovery.num_lists == 2
            kinds = [("watch" if r.watch else "list") for r in h.api.requests]
            assert kinds[:4] == ["list", "watch", "watch", "watch"], kinds  # 500, then 410
            assert kinds[4] == "list", kinds
            assert h.discovery.resource_version is not None
            assert int(h.discovery.resource_version) >= int(h.api.resource_version)

            await h.api.put(make_pod("w3", ip="10.0.0.4"))  # the new watch follows the new list
            await h.wait_for(lambda ws: set(ws) == {"w0", "w2", "w3"})

    asyncio.run(scenario())


def test_errors_are_retried_with_backoff_and_keep_the_last_workers() -> None:
    async def scenario() -> None:
        async with running([make_pod("w0")]) as h:
            await h.wait_for(lambda ws: set(ws) == {"w0"})
            await h.wait_requests(2)
            h.api.fail_next = 3
            await h.api.expire_watches()
            await h.wait_requests(6)  # three failures, then a watch that works
            assert set(h.current) == {"w0"}, "a failing API server does not drop workers"
            await h.api.put(make_pod("w1", ip="10.0.0.2"))
            await h.wait_for(lambda ws: set(ws) == {"w0", "w1"})
            assert h.discovery.num_lists == 1

    asyncio.run(scenario())


def test_initial_list_failure_is_retried() -> None:
    async def scenario() -> None:
        async with running([make_pod("w0")], fail_first=2) as h:
            await h.wait_for(lambda ws: set(ws) == {"w0"})
            await h.wait_requests(4)
            assert [r.watch for r in h.api.requests[:4]] == [False, False, False, True]
            assert h.discovery.num_lists == 1
            assert len(h.changes) == 1, "nothing is reported before the first successful list"

    asyncio.run(scenario())


def test_stop_returns_promptly_while_a_watch_is_open() -> None:
    async def scenario() -> None:
        async with running([make_pod("w0")]) as h:
            await h.wait_requests(2)
            loop = asyncio.get_running_loop()
            started = loop.time()
        assert loop.time() - started < 2.0

    asyncio.run(scenario())


def test_a_failed_on_change_is_delivered_again() -> None:
    async def scenario() -> None:
        async with running([make_pod("w0")], fail_on_change=1) as h:  # the initial set fails once
            await h.wait_for(lambda ws: set(ws) == {"w0"})
            await h.wait_requests(3)  # list (delivery failed), list, watch
            h.fail_on_change = 1  # and a watch event fails once
            await h.api.put(make_pod("w1", ip="10.0.0.2"))
            await h.wait_for(lambda ws: set(ws) == {"w0", "w1"})
            assert [sorted(w.worker_id for w in c) for c in h.changes] == [["w0"], ["w0", "w1"]]
            assert h.discovery.num_lists == 2

    asyncio.run(scenario())


def test_bookmarks_move_the_resume_point_past_other_pods_changes() -> None:
    async def scenario() -> None:
        async with running([make_pod("w0")]) as h:
            await h.wait_for(lambda ws: set(ws) == {"w0"})
            await h.wait_requests(2)
            other_rv = await h.api.put(make_pod("x0", instance="other"))  # not ours: no event reaches us
            await h.api.bookmark()
            for _ in range(200):
                if h.discovery.resource_version == other_rv:
                    break
                await asyncio.sleep(0.01)
            assert h.discovery.resource_version == other_rv
            await h.api.expire_watches()
            await h.wait_requests(3)
            assert h.api.requests[2].resource_version == other_rv
            assert len(h.changes) == 1, "a bookmark changes no worker"

    asyncio.run(scenario())


def test_loopback_map_dials_pods_on_loopback_and_leaves_out_other_ips() -> None:
    async def scenario() -> None:
        pods = [make_pod("w1", ip="10.244.0.1"), make_pod("w7", ip="10.244.0.7", grpc_port=6000),
                make_pod("w-outside", ip="10.0.0.9"), make_pod("w-v6", ip="fd00::7")]
        async with running(pods, loopback=PodLoopbackMap(pod_cidr="10.244.0.0/24", base_port=30000)) as h:
            await h.wait_for(lambda ws: len(ws) > 0)
            assert {w.worker_id: w.address for w in h.changes[-1]} == {
                "w1": "127.0.0.1:30001", "w7": "127.0.0.1:30007"}, "the port annotation is ignored"
            await h.api.put(make_pod("w7", ip="10.244.0.9"))  # back with a new IP: a new port
            await h.wait_for(lambda ws: ws.get("w7") is not None and ws["w7"].address == "127.0.0.1:30009")

    asyncio.run(scenario())
