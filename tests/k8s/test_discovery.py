"""The router's Kubernetes discovery end to end, on a real API server with the chart installed.

The router runs with the chart's own flags and a token of the chart's own ServiceAccount, so the chart's
Role is all it may use. It finds the worker pods kwok runs; a fake worker process per pod answers on a
loopback port the discovery's test hook maps the pod's IP to (no packet goes to a pod IP).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from radixmesh.protocol import common_pb2, sampling_pb2, worker_pb2
from radixmesh.router.discovery.loopback_map import PodLoopbackMap
from tests.k8s.control_plane import POD_CIDR, ControlPlane
from tests.k8s.helm_release import Helm
from tests.k8s.kube import running_pods, wait_for
from tests.k8s.router_proc import RouterProc, chart_router_args, free_port_block, service_account_token, start_router
from tests.k8s.worker_proc import WorkerProc, start_worker, stop_workers

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

RELEASE = "disc"
FULLNAME = f"{RELEASE}-radixmesh"
WORKERS = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=worker"
REACTION_LIMIT_S = 2.0
"""The issue's bound on how long a gone or not-Ready pod may stay in the rotation."""


class Pool:
    """Fake worker processes for the release's worker pods, one per pod IP (on its mapped loopback port)."""

    def __init__(self, core: Any, namespace: str, loopback: PodLoopbackMap, log_dir: Path) -> None:
        self.core, self.namespace, self.loopback, self.log_dir = core, namespace, loopback, log_dir
        self.workers: dict[str, WorkerProc] = {}

    def sync(self, count: int) -> set[str]:
        """Wait for exactly `count` worker pods Running and Ready, start a worker for each that has none;
        their names."""
        def ready() -> list[Any] | None:
            pods = running_pods(self.core, self.namespace, WORKERS)
            return pods if len(pods) == count else None

        pods = wait_for(ready, 60, f"{count} worker pods Running and Ready")
        for pod in pods:
            if pod.metadata.name not in self.workers:
                address = self.loopback.address_of(pod.status.pod_ip)
                assert address is not None, f"pod IP {pod.status.pod_ip} outside {POD_CIDR}"
                port = int(address.rsplit(":", 1)[1])
                self.workers[pod.metadata.name] = start_worker(pod.metadata.name, port, self.log_dir)
        return {p.metadata.name for p in pods}

    def close(self) -> None:
        stop_workers(list(self.workers.values()))


def serving(router: RouterProc, pool: Pool, count: int) -> set[str]:
    """Once `count` worker pods are Ready with their workers, and the router has exactly those healthy: them."""
    pods = pool.sync(count)
    wait_for(lambda: router.healthy() == pods, 30, f"the router with exactly {sorted(pods)} healthy")
    return pods


def generate_on(router: RouterProc, num_requests: int) -> set[str]:
    """Pods (worker ids) that served `num_requests` Generate calls through the router."""
    served = set()
    for i in range(num_requests):
        request = worker_pb2.GenerateRequest(request_id=f"r{time.monotonic_ns()}-{i}", token_ids=[i + 1] * 20,
                                             sampling_params=sampling_pb2.SamplingParams(max_new_tokens=3))
        messages = list(router.stub.Generate(request, timeout=10))
        assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH, messages[-1]
        served.add(messages[0].routing.worker_id)
    return served


def time_until_gone(router: RouterProc, pod: str, started: float, timeout_s: float = 10.0) -> float:
    """Seconds from `started` until the router's registry no longer lists `pod`."""
    wait_for(lambda: pod not in router.workers(), timeout_s, f"{pod} out of the router's workers", poll_s=0.01)
    return time.monotonic() - started


@pytest.fixture
def helm(k8s: ControlPlane, helm_binary: str, kubectl_binary: str) -> Helm:
    return Helm(helm_binary, k8s.kubeconfig, kubectl_binary)


@pytest.fixture
def deployed(k8s: ControlPlane, helm: Helm, namespace: str, tmp_path: Path) -> Iterator[tuple[RouterProc, Pool]]:
    """The chart with two workers, their fake worker processes, and a router with the chart's flags and
    ServiceAccount token (policy round-robin, so that every worker gets requests)."""
    from kubernetes import client

    helm.install(RELEASE, namespace, sets=["workers.unified.replicas=2", "redis.mode=none"])
    api_client = k8s.api_client()
    deployment = client.AppsV1Api(api_client).read_namespaced_deployment(f"{FULLNAME}-router", namespace)
    account = deployment.spec.template.spec.service_account_name
    assert account == f"{FULLNAME}-router"
    token = service_account_token(api_client, namespace, account)
    kubeconfig = k8s.write_kubeconfig(tmp_path / "router.kubeconfig", token, namespace)
    loopback = PodLoopbackMap(pod_cidr=POD_CIDR, base_port=free_port_block())
    pool = Pool(client.CoreV1Api(api_client), namespace, loopback, tmp_path)
    router = None
    try:
        pool.sync(2)
        router = start_router([*chart_router_args(deployment), "--policy=round-robin"], kubeconfig, loopback,
                              tmp_path)
        yield router, pool
    finally:
        if router is not None:
            router.stop()
        pool.close()


def test_router_role_is_exactly_read_pods(k8s: ControlPlane, deployed: tuple[RouterProc, Pool],
                                          namespace: str) -> None:
    from kubernetes import client

    rbac = client.RbacAuthorizationV1Api(k8s.api_client())
    role = rbac.read_namespaced_role(f"{FULLNAME}-router-pod-reader", namespace)
    assert [(r.api_groups, r.resources, sorted(r.verbs)) for r in role.rules] == \
        [([""], ["pods"], ["get", "list", "watch"])]
    binding = rbac.read_namespaced_role_binding(f"{FULLNAME}-router-pod-reader", namespace)
    assert [(s.kind, s.name, s.namespace) for s in binding.subjects] == \
        [("ServiceAccount", f"{FULLNAME}-router", namespace)]

    token = service_account_token(k8s.api_client(), namespace, f"{FULLNAME}-router")
    as_router = k8s.api_client(token)
    auth = client.AuthorizationV1Api(as_router)

    def allowed(verb: str, resource: str, ns: str = namespace) -> bool:
        review = {"spec": {"resourceAttributes": {"namespace": ns, "verb": verb, "resource": resource}}}
        return bool(auth.create_self_subject_access_review(review).status.allowed)

    assert all(allowed(verb, "pods") for verb in ("get", "list", "watch"))
    assert not any(allowed(verb, "pods") for verb in ("create", "update", "patch", "delete", "deletecollection"))
    assert not allowed("list", "pods", "default"), "pods of other namespaces"
    assert not any(allowed("list", r) for r in ("secrets", "services", "endpoints", "configmaps"))
    core = client.CoreV1Api(as_router)
    pod = core.list_namespaced_pod(namespace, label_selector=WORKERS).items[0].metadata.name
    with pytest.raises(client.ApiException) as denied:
        core.delete_namespaced_pod(pod, namespace)
    assert denied.value.status == 403


def test_router_follows_pods(k8s: ControlPlane, deployed: tuple[RouterProc, Pool], namespace: str,
                             k8s_timings: dict[str, float]) -> None:
    from kubernetes import client

    router, pool = deployed
    core = client.CoreV1Api(k8s.api_client())
    pods = serving(router, pool, 2)
    listed = router.workers()
    assert set(listed) == pods
    for name in pods:
        assert listed[name].address == pool.workers[name].address, "dialled on the pod's mapped loopback port"
    assert generate_on(router, 4) == pods, "round-robin reaches every worker pod"

    gone = sorted(pods)[0]
    started = time.monotonic()
    core.delete_namespaced_pod(gone, namespace)
    k8s_timings["discovery: deleted pod out of rotation"] = took = time_until_gone(router, gone, started)
    assert took < REACTION_LIMIT_S, f"a deleted pod stayed {took:.2f} s in the rotation"
    pool.workers.pop(gone).stop()
    pods = serving(router, pool, 2)  # the ReplicaSet's replacement, with a new IP and worker
    assert gone not in pods

    unready = sorted(pods)[0]
    started = time.monotonic()
    core.patch_namespaced_pod_status(unready, namespace, {"status": {"conditions": [
        {"type": "Ready", "status": "False", "reason": "ReadinessProbeFailed"}]}})
    k8s_timings["discovery: not-Ready pod out of rotation"] = took = time_until_gone(router, unready, started)
    assert took < REACTION_LIMIT_S, f"a not-Ready pod stayed {took:.2f} s in the rotation"
    assert unready not in generate_on(router, 4)

    client.AppsV1Api(k8s.api_client()).patch_namespaced_deployment_scale(
        f"{FULLNAME}-worker-unified", namespace, {"spec": {"replicas": 4}})
    started = time.monotonic()
    # 4 pods, 3 of them Ready (one was made not-Ready above): the router serves exactly the Ready ones
    ready = serving(router, pool, 3)
    k8s_timings["discovery: scale 2 -> 4 pods to healthy workers"] = time.monotonic() - started
    assert unready not in ready and len(ready - pods) == 2
    assert generate_on(router, 6) == ready
