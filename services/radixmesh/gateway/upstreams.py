"""The gateway's gRPC dependencies, watched in the background: the tokenizer service and the routers
(one or more replicas) or one worker.

The gateway serves HTTP from its first second. Each dependency is health-checked (grpc.health.v1)
every `check_interval_s` while it answers and with capped exponential backoff while it does not;
the gateway is ready while the tokenizer and at least one target replica report SERVING. Requests go
to the ready replicas in turn; a replica a request finds unreachable is checked again at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from radixmesh.common import aio, tls, tracing
from radixmesh.common.errors import ErrorCode, RadixMeshError, invalid_argument
from radixmesh.common.grpc_server import RECONNECT_OPTIONS, check_peer_health
from radixmesh.common.lane import PeerLane
from radixmesh.common.readiness import Readiness
from radixmesh.protocol import worker_pb2

logger = logging.getLogger(__name__)
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20),
                   *RECONNECT_OPTIONS]


@dataclass(frozen=True)
class WatchConfig:
    """How often the gateway checks its dependencies."""

    check_interval_s: float = 1.0
    """Seconds between health checks of a dependency that answers."""
    retry_min_s: float = 0.2
    """First wait before checking a dependency that did not answer again (doubles up to retry_max_s)."""
    retry_max_s: float = 2.0
    """Longest wait between checks of a dependency that does not answer."""
    check_timeout_s: float = 2.0
    """Bound on one health check."""

    def __post_init__(self) -> None:
        if min(self.check_interval_s, self.retry_min_s, self.check_timeout_s) <= 0:
            raise invalid_argument("dependency check intervals and timeouts must be > 0", "check_interval_s")
        if self.retry_max_s < self.retry_min_s:
            raise invalid_argument("retry_max_s must be >= retry_min_s", "retry_max_s")


def parse_addresses(spec: str, kind: str) -> list[str]:
    """host:port replicas of a comma-separated flag value (duplicates and malformed entries are errors)."""
    addresses = [part.strip() for part in spec.split(",") if part.strip()]
    if not addresses:
        raise invalid_argument(f"--{kind} needs at least one host:port", kind)
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise invalid_argument(f"--{kind}: {address!r} is not host:port", kind)
    if len(set(addresses)) != len(addresses):
        raise invalid_argument(f"--{kind} lists an address twice", kind)
    return addresses


class Upstream:
    """One replica of a dependency: its channel, stub and last known health."""

    lane: PeerLane | None = None
    """The replica's Generate lane, learnt from GetLoad (None: Generate always over gRPC: a tokenizer, the
    gateway's transport is grpc, TLS, the router in this process)."""
    _lane_asked = False
    """GetLoad answered since the replica last came up."""

    def __init__(self, kind: str, address: str, stub_class: Callable[[Any], Any], use_lane: bool = False) -> None:
        self.kind, self.address = kind, address
        self.channel = tls.aio_channel(address, options=CHANNEL_OPTIONS, interceptors=tracing.client_interceptors())
        self.stub: Any = stub_class(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.up = False
        self.detail = "not contacted yet"
        self.wake = asyncio.Event()
        """Set to check again now (a request found the replica unreachable)."""
        if use_lane and tls.client_tls() is None:
            self.lane = PeerLane(address, self.description)

    @property
    def description(self) -> str:
        return f"the {self.kind} at {self.address}"

    async def check_lane(self, up: bool, timeout_s: float) -> None:
        """After a health check: ask for the Generate lane (GetLoad) once each time the replica comes up; while it
        is down, forget a port that refused (it may come back on the same one)."""
        if self.lane is None:
            return
        if not up:
            self._lane_asked = False
            self.lane.forget_refusal()
            return
        if self._lane_asked:
            return
        try:
            reply = await self.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return  # asked again on the next check
        self._lane_asked = True
        self.lane.learn(reply.lane_port)

    async def close(self) -> None:
        if self.lane is not None:
            await self.lane.close()
        await self.channel.close()


class UpstreamGroup:
    """Replicas of one dependency (one tokenizer, N routers, one worker): up while any replica is up."""

    def __init__(self, name: str, upstreams: Sequence[Upstream]) -> None:
        assert upstreams, f"{name}: no replica"
        self.name = name
        self.upstreams = list(upstreams)
        self._turn = itertools.count()

    @property
    def description(self) -> str:
        if len(self.upstreams) == 1:
            return self.upstreams[0].description
        return f"a {self.upstreams[0].kind} at {' or '.join(u.address for u in self.upstreams)}"

    @property
    def up(self) -> bool:
        return any(u.up for u in self.upstreams)

    @property
    def detail(self) -> str:
        if len(self.upstreams) == 1:
            return self.upstreams[0].detail
        return "; ".join(f"{u.address}: {u.detail or 'up'}" for u in self.upstreams)

    def ready(self) -> list[Upstream]:
        """The replicas that answer now, rotated so that successive calls start at different ones."""
        ready = [u for u in self.upstreams if u.up]
        if not ready:
            return []
        start = next(self._turn) % len(ready)
        return ready[start:] + ready[:start]


class UpstreamWatcher:
    """Health-checks every replica of every group and keeps `readiness` current (one dependency per group)."""

    def __init__(self, groups: Sequence[UpstreamGroup], readiness: Readiness, config: WatchConfig,
                 on_change: Callable[[], None] | None = None) -> None:
        self.groups = list(groups)
        self.readiness = readiness
        self.config = config
        self.on_change = on_change
        """Called after any replica's up/down state changed (the backend fetches the model card)."""
        for group in self.groups:
            readiness.add(group.name, group.description, detail=group.detail)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch(group, u), name=f"watch-{u.kind}-{u.address}")
                       for group in self.groups for u in group.upstreams]

    async def _watch(self, group: UpstreamGroup, upstream: Upstream) -> None:
        retry_s = self.config.retry_min_s
        while True:
            up, detail = await check_peer_health(upstream.health, self.config.check_timeout_s)
            await upstream.check_lane(up, self.config.check_timeout_s)
            self.record(group, upstream, up, detail)
            wait_s = self.config.check_interval_s if up else retry_s
            retry_s = self.config.retry_min_s if up else min(self.config.retry_max_s, retry_s * 2)
            upstream.wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await aio.wait_for(upstream.wake.wait(), wait_s)

    def record(self, group: UpstreamGroup, upstream: Upstream, up: bool, detail: str) -> None:
        changed = upstream.up != up
        upstream.up, upstream.detail = up, detail
        if changed and len(group.upstreams) > 1:  # with one replica the readiness log says it
            if up:
                logger.warning("gateway: %s answers", upstream.description)
            else:
                logger.warning("gateway: %s is unavailable: %s", upstream.description, detail)
        self.readiness.set(group.name, group.up, group.detail)
        if changed and self.on_change is not None:
            self.on_change()

    def mark_down(self, group: UpstreamGroup, upstream: Upstream, detail: str) -> None:
        """A call found the replica unreachable: stop sending it requests and check it again now."""
        self.record(group, upstream, False, detail)
        upstream.wake.set()

    async def close(self) -> None:
        await aio.cancel_and_wait(*self._tasks)
        self._tasks = []
        for group in self.groups:
            for upstream in group.upstreams:
                await upstream.close()


def not_ready_error(reason: str) -> RadixMeshError:
    return RadixMeshError(ErrorCode.UNAVAILABLE, reason or "the gateway is starting")
