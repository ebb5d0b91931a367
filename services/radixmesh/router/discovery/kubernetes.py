"""Kubernetes discovery: worker pods selected by labels in one namespace, listed then watched.

The loop is the usual list-then-watch ("reflector") shape: list the pods to get the full
state and a resourceVersion, then watch from that version, applying ADDED / MODIFIED /
DELETED events. When the API server ends a watch (its timeout, a restart, a dropped
connection) the watch resumes from the last resourceVersion seen, so nothing is missed and
nothing is replayed. When that version is too old (410 Gone) the pods are listed again and
the state replaced. Other failures are retried with capped exponential backoff and jitter;
the last known workers stay in place meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixmesh.common import aio
from radixmesh.common.errors import invalid_argument
from radixmesh.router.discovery.base import BaseDiscovery, OnChange, WorkerEndpoint
from radixmesh.router.discovery.kubernetes_pods import endpoint_from_pod, pod_name
from radixmesh.router.discovery.loopback_map import PodLoopbackMap, pod_loopback_map_from_env

logger = logging.getLogger(__name__)

IN_CLUSTER_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
"""Written into every pod that mounts a service account token: the pod's own namespace."""

ClientFactory = Callable[[], Awaitable[Any]]
"""Returns a `kubernetes.aio.client.ApiClient` (closed by the discovery when it stops)."""


@dataclass(frozen=True)
class KubernetesDiscoveryConfig:
    """What to watch and how hard to retry."""

    selector: str
    """Label selector of the worker pods, e.g. app.kubernetes.io/component=worker,app.kubernetes.io/instance=rm."""
    namespace: str
    """Namespace of the worker pods (a Role grants pods get/list/watch in it)."""
    watch_timeout_s: int = 300
    """Server-side timeout of one watch request; the watch then resumes from its resourceVersion."""
    request_timeout_s: float = 30.0
    """Client-side timeout of a list request (a watch gets watch_timeout_s plus this)."""
    backoff_initial_s: float = 0.5
    """First retry delay after a failed list or watch."""
    backoff_max_s: float = 30.0
    """Cap of the exponentially growing retry delay."""
    loopback: PodLoopbackMap | None = None
    """Test hook: dial pods on 127.0.0.1 ports instead of their IPs (loopback_map.py); None in deployments."""

    def __post_init__(self) -> None:
        if not self.selector.strip():
            raise invalid_argument("kubernetes discovery needs a label selector (--selector)", "selector")
        if not self.namespace:
            raise invalid_argument("kubernetes discovery needs a namespace (--namespace)", "namespace")
        if self.watch_timeout_s < 1:
            raise invalid_argument(f"watch_timeout_s must be >= 1, got {self.watch_timeout_s}")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise invalid_argument("backoff must satisfy 0 < backoff_initial_s <= backoff_max_s")


class _Gone(Exception):
    """The resourceVersion we hold is too old for the API server (HTTP 410): list again."""


class KubernetesDiscovery(BaseDiscovery):
    """Reports the Ready worker pods that match a label selector (see the module docstring)."""

    def __init__(self, config: KubernetesDiscoveryConfig, client_factory: ClientFactory) -> None:
        self.config = config
        self._client_factory = client_factory
        self._endpoints: dict[str, WorkerEndpoint | None] = {}  # pod name -> endpoint (None: not ready)
        self._reported: list[WorkerEndpoint] | None = None
        self._stopped = asyncio.Event()
        self._watch: Any = None
        self.resource_version: str | None = None
        """Last resourceVersion seen (list or watch event); the watch resumes from it."""
        self.num_lists = 0
        """How many times the pods were listed (1 + re-lists after 410 Gone)."""

    async def run(self, on_change: OnChange) -> None:
        loop_task = asyncio.ensure_future(self._run_loop(on_change))
        stop_task = asyncio.ensure_future(self._stopped.wait())
        try:
            await asyncio.wait({loop_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (loop_task, stop_task):
                task.cancel()
            await asyncio.gather(loop_task, stop_task, return_exceptions=True)
        if loop_task.done() and not loop_task.cancelled() and loop_task.exception() is not None:
            raise loop_task.exception()  # type: ignore[misc]

    async def stop(self) -> None:
        self._stopped.set()
        if self._watch is not None:
            self._watch.stop()

    async def _run_loop(self, on_change: OnChange) -> None:
        from kubernetes.aio import client

        api_client = await self._client_factory()
        api = client.CoreV1Api(api_client)
        delay_s = self.config.backoff_initial_s
        try:
            while not self._stopped.is_set():
                if await self._step(api, on_change):
                    delay_s = self.config.backoff_initial_s
                    continue
                await self._sleep(delay_s * random.uniform(0.8, 1.2))
                delay_s = min(delay_s * 2, self.config.backoff_max_s)
        finally:
            await api_client.close()

    async def _step(self, api: Any, on_change: OnChange) -> bool:
        """List when needed, then follow one watch; False when the caller should back off first."""
        from kubernetes.aio import client

        try:
            if self.resource_version is None:
                await self._relist(api, on_change)
            return await self._watch_once(api, on_change)
        except _Gone:
            logger.info("kubernetes discovery: resourceVersion %s expired (410 Gone); listing again",
                        self.resource_version)
            self.resource_version = None
            return True
        except client.ApiException as exc:
            _log_api_error(exc, self.config)
        except Exception as exc:  # connection resets, timeouts, malformed lines: all retried
            logger.warning("kubernetes discovery: %s: %s; retrying", type(exc).__name__, exc)
        return False

    async def _relist(self, api: Any, on_change: OnChange) -> None:
        from kubernetes.aio import client

        response = await api.list_namespaced_pod_without_preload_content(
            self.config.namespace, label_selector=self.config.selector,
            _request_timeout=float(self.config.request_timeout_s))
        async with response:
            body = await response.json(content_type=None)
        if response.status != 200:
            message = body.get("message", body) if isinstance(body, dict) else body
            raise client.ApiException(status=response.status, reason=str(message))
        self.num_lists += 1
        self._endpoints = {pod_name(pod): self._endpoint(pod) for pod in body.get("items") or []}
        list_version = str((body.get("metadata") or {}).get("resourceVersion") or "") or None
        logger.info("kubernetes discovery: listed %d pods (%s) in %s at resourceVersion %s",
                    len(self._endpoints), self.config.selector, self.config.namespace, list_version)
        await self._report(on_change)
        self.resource_version = list_version  # after delivery: if on_change fails, the list is retried

    async def _watch_once(self, api: Any, on_change: OnChange) -> bool:
        """Follow one watch request until the server ends it.

        True when it ended normally after delivering events or lasting a while: resume at once.
        A watch that ends at once with nothing in it is treated like an error (backoff), so a
        misbehaving server cannot make the loop spin.
        """
        from kubernetes.aio import client, watch

        self._watch = watch.Watch()
        num_events = 0
        started = time.monotonic()
        try:
            stream = self._watch.stream(
                api.list_namespaced_pod, self.config.namespace, label_selector=self.config.selector,
                resource_version=self.resource_version, allow_watch_bookmarks=True,
                timeout_seconds=self.config.watch_timeout_s,
                _request_timeout=float(self.config.watch_timeout_s + self.config.request_timeout_s))
            async for event in stream:
                num_events += 1
                await self._apply(event, on_change)
                self.resource_version = self._watch.resource_version or self.resource_version
        except client.ApiException as exc:
            if exc.status == 410:
                raise _Gone() from None
            raise
        finally:
            await self._watch.close()
            self._watch = None
        return num_events > 0 or time.monotonic() - started >= 1.0

    async def _apply(self, event: Any, on_change: OnChange) -> None:
        if not isinstance(event, dict) or "type" not in event:
            raise ValueError(f"unexpected watch line: {str(event)[:200]!r}")
        kind = event["type"]
        if kind == "BOOKMARK":
            return
        pod = event["raw_object"]
        name = pod_name(pod)
        if kind == "DELETED":
            self._endpoints.pop(name, None)
        elif kind in ("ADDED", "MODIFIED"):
            self._endpoints[name] = self._endpoint(pod)
        else:
            logger.warning("kubernetes discovery: watch event of unknown type %r ignored", kind)
            return
        await self._report(on_change)

    def _endpoint(self, pod: dict[str, Any]) -> WorkerEndpoint | None:
        endpoint = endpoint_from_pod(pod)
        if endpoint is None or self.config.loopback is None:
            return endpoint
        return self.config.loopback.apply(endpoint)

    async def _report(self, on_change: OnChange) -> None:
        current = sorted((e for e in self._endpoints.values() if e is not None), key=lambda e: e.worker_id)
        if current == self._reported:
            return
        logger.info("kubernetes discovery: %d ready workers: %s", len(current),
                    ", ".join(f"{e.worker_id}={e.address}/{e.role}" for e in current) or "none")
        result = on_change(list(current))
        if inspect.isawaitable(result):
            await result
        self._reported = current  # only once delivered: a failed on_change is retried

    async def _sleep(self, delay_s: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await aio.wait_for(self._stopped.wait(), delay_s)


def _log_api_error(exc: Any, config: KubernetesDiscoveryConfig) -> None:
    if exc.status in (401, 403):
        logger.error("kubernetes discovery: API server answered %s %s: the router's service account needs "
                     "get/list/watch on pods in namespace %s (the chart's Role grants it); retrying",
                     exc.status, exc.reason, config.namespace)
    else:
        logger.warning("kubernetes discovery: API error %s %s; retrying", exc.status, exc.reason)


def make_kubernetes_discovery(selector: str, namespace: str | None = None) -> BaseDiscovery:
    """Discovery of worker pods, with the in-cluster service account, else the local kubeconfig.

    `namespace` None means the router's own namespace in a cluster, else the kubeconfig
    context's namespace, else "default".
    """
    config = KubernetesDiscoveryConfig(selector=selector, namespace=namespace or default_namespace(),
                                       loopback=pod_loopback_map_from_env())
    return KubernetesDiscovery(config, load_api_client)


def in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and IN_CLUSTER_NAMESPACE_FILE.parent.is_dir()


def default_namespace() -> str:
    if in_cluster() and IN_CLUSTER_NAMESPACE_FILE.is_file():
        return IN_CLUSTER_NAMESPACE_FILE.read_text().strip() or "default"
    try:
        from kubernetes.aio import config as kube_config

        _, active = kube_config.list_kube_config_contexts()
        return str((active or {}).get("context", {}).get("namespace") or "default")
    except Exception:  # no kubeconfig, or one without contexts: load_api_client reports it
        return "default"


async def load_api_client() -> Any:
    """An ApiClient configured from the pod's service account, else from ~/.kube/config ($KUBECONFIG)."""
    from kubernetes.aio import client
    from kubernetes.aio import config as kube_config

    configuration = client.Configuration()
    try:
        if in_cluster():
            kube_config.load_incluster_config(client_configuration=configuration)
        else:
            await kube_config.load_kube_config(client_configuration=configuration)
    except (kube_config.ConfigException, OSError) as exc:
        raise invalid_argument(f"kubernetes discovery: no in-cluster service account and no usable "
                               f"kubeconfig ({exc})") from None
    return client.ApiClient(configuration)
