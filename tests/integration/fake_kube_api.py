"""A small Kubernetes API for pods, served on 127.0.0.1, speaking the list/watch protocol.

It keeps pods with a global resourceVersion counter and an event history, the way the API
server's watch cache does:
- GET /api/v1/namespaces/NS/pods            -> PodList with metadata.resourceVersion
- GET ...?watch=true&resourceVersion=RV     -> a stream of JSON lines (ADDED/MODIFIED/DELETED)
  with every event after RV, then new events as they happen, until timeoutSeconds or
  `expire_watches()` closes the stream;
- a watch from an RV older than the compacted history gets an ERROR event with a 410 Status.
Label selectors support equality terms (`a=b,c=d`), which is what the chart uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class ApiRequest:
    """One request the fake received (for assertions on resume behaviour)."""

    watch: bool
    resource_version: str | None
    label_selector: str | None


@dataclass
class FakeKubeApi:
    namespace: str = "serving"
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[ApiRequest] = field(default_factory=list)
    fail_next: int = 0
    """Answer this many upcoming requests with HTTP 500."""
    _rv: int = 100
    _history: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    _compacted_rv: int = 0
    _changed: asyncio.Condition | None = None
    _generation: int = 0
    _bookmark_rv: int = 0
    _runner: web.AppRunner | None = None
    port: int = 0

    async def start(self) -> str:
        self._changed = asyncio.Condition()
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{self.port}"

    async def close(self) -> None:
        await self.expire_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    # --- changes, as the kubelet and controllers would make them -------------------------

    async def put(self, pod: dict[str, Any]) -> str:
        """Create or replace a pod; returns its new resourceVersion."""
        name = pod["metadata"]["name"]
        kind = "MODIFIED" if name in self.pods else "ADDED"
        return await self._record(kind, pod)

    async def delete(self, name: str) -> str:
        return await self._record("DELETED", self.pods[name])

    async def expire_watches(self) -> None:
        """End every open watch stream, as the API server does when a watch times out."""
        assert self._changed is not None
        async with self._changed:
            self._generation += 1
            self._changed.notify_all()

    async def bookmark(self) -> None:
        """Send every open watch a BOOKMARK at the current resourceVersion (as the API server does
        periodically when allowWatchBookmarks is set), even if no event matched its selector."""
        assert self._changed is not None
        self._bookmark_rv = self._rv
        async with self._changed:
            self._changed.notify_all()

    def compact(self) -> None:
        """Forget the event history: watches from any older resourceVersion now get 410 Gone."""
        self._compacted_rv = self._rv
        self._history.clear()

    @property
    def resource_version(self) -> str:
        return str(self._rv)

    async def _record(self, kind: str, pod: dict[str, Any]) -> str:
        assert self._changed is not None
        self._rv += 1
        pod = copy.deepcopy(pod)
        pod["metadata"]["resourceVersion"] = str(self._rv)
        pod["metadata"].setdefault("namespace", self.namespace)
        if kind == "DELETED":
            self.pods.pop(pod["metadata"]["name"], None)
        else:
            self.pods[pod["metadata"]["name"]] = pod
        self._history.append((self._rv, kind, pod))
        async with self._changed:
            self._changed.notify_all()
        return str(self._rv)

    # --- HTTP --------------------------------------------------------------------------

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        query = request.query
        watch = query.get("watch") in ("true", "1")
        self.requests.append(ApiRequest(watch, query.get("resourceVersion"), query.get("labelSelector")))
        if self.fail_next > 0:
            self.fail_next -= 1
            return _status(500, "InternalError", "injected failure")
        if request.match_info["namespace"] != self.namespace:
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": self.resource_version}, "items": []})
        selector = _parse_selector(query.get("labelSelector", ""))
        if not watch:
            items = [p for p in self.pods.values() if _matches(p, selector)]
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": self.resource_version}, "items": items})
        return await self._watch(request, selector, int(query.get("resourceVersion") or self._rv),
                                 int(query.get("timeoutSeconds") or 300))

    async def _watch(self, request: web.Request, selector: dict[str, str], since_rv: int,
                     timeout_s: int) -> web.StreamResponse:
        assert self._changed is not None
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await response.prepare(request)
        if since_rv < self._compacted_rv:
            gone = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": f"too old resource version: {since_rv} ({self._compacted_rv})",
                    "reason": "Expired", "code": 410}
            await _write_line(response, {"type": "ERROR", "object": gone})
            return response
        generation = self._generation
        sent_rv = since_rv
        bookmarks = request.query.get("allowWatchBookmarks") in ("true", "1")
        bookmark_sent = self._bookmark_rv
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while generation == self._generation and loop.time() < deadline:
            for rv, kind, pod in list(self._history):
                if rv > sent_rv and _matches(pod, selector):
                    await _write_line(response, {"type": kind, "object": pod})
                if rv > sent_rv:
                    sent_rv = rv
            if bookmarks and self._bookmark_rv > bookmark_sent:
                bookmark_sent = self._bookmark_rv
                await _write_line(response, {"type": "BOOKMARK", "object": {
                    "kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(self._bookmark_rv)}}})
            async with self._changed:
                pending_bookmark = bookmarks and self._bookmark_rv > bookmark_sent
                idle = not pending_bookmark and not any(rv > sent_rv for rv, _, _ in self._history)
                if generation == self._generation and idle:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), timeout=max(0.01, deadline - loop.time()))
        return response


async def _write_line(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(json.dumps(event).encode() + b"\n")


def _status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": message, "reason": reason, "code": code}, status=code)


def _parse_selector(text: str) -> dict[str, str]:
    terms = [t for t in text.split(",") if t]
    assert all("=" in t and "!=" not in t for t in terms), f"fake API supports only equality selectors: {text}"
    return dict(t.replace("==", "=").split("=", 1) for t in terms)


def _matches(pod: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def make_pod(name: str, *, role: str = "unified", ready: bool = True, ip: str | None = "10.0.0.1",
             grpc_port: int | str | None = 50051, instance: str = "rm", phase: str = "Running") -> dict[str, Any]:
    """A worker pod as the chart would create it, in the state the kubelet reports."""
    annotations = {} if grpc_port is None else {"radixmesh.io/grpc-port": str(grpc_port)}
    status: dict[str, Any] = {"phase": phase, "conditions": [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "True" if ready else "False"},
    ]}
    if ip is not None:
        status["podIP"] = ip
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/component": "worker",
                                              "app.kubernetes.io/instance": instance,
                                              "radixmesh.io/role": role},
                     "annotations": annotations},
        "spec": {"containers": [{"name": "worker", "image": "radixmesh-worker:test"}]},
        "status": status,
    }
