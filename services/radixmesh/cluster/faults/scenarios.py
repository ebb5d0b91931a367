"""Fault scenarios, one fault each, behind a registry keyed by kebab-case ids.

A scenario picks the gateway the load goes to (`setup`), injects its fault (`inject`), keeps it
for `hold_s`, ends it (`heal`: restart, SIGCONT, proxy back to pass) and says how the system shows
that it noticed (`detected`, polled from the fault on; None: only failed requests tell).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from dataclasses import dataclass

from radixmesh.cluster.faults.harness import FaultCluster
from radixmesh.cluster.faults.load import LoadGen, RequestSpec, chat_stream
from radixmesh.cluster.faults.proxy import FaultProxy
from radixmesh.cluster.processes import http_ok


@dataclass(frozen=True)
class Pace:
    """Scenario timing: the full suite, or shorter faults for CI (`--short`)."""

    short: bool

    def hold_s(self, full_s: float, short_s: float) -> float:
        return short_s if self.short else full_s


class Scenario:
    """One fault. Subclasses set `id` and `fault` and override what their fault needs."""

    id = ""
    fault = ""
    """What is done, in a few words (the table's second column)."""

    def __init__(self, cluster: FaultCluster, pace: Pace) -> None:
        self.cluster = cluster
        self.pace = pace

    async def setup(self) -> str:
        """The gateway URL the load goes to."""
        return self.cluster.gateway_url

    async def teardown(self) -> None:
        return None

    @property
    def hold_s(self) -> float:
        return self.pace.hold_s(6.0, 3.0)

    async def inject(self, load: LoadGen) -> None:
        raise NotImplementedError

    async def heal(self) -> None:
        return None

    def detected(self) -> bool | None:
        return None

    def extra(self) -> dict[str, object]:
        """Scenario-specific figures for the results."""
        return {}

    victim: str = ""
    """The worker a worker fault hits: the busiest when the fault begins (the proxied one for proxies)."""
    fault_times: list[float]
    """When the fault (each step of it) began, seconds since the load started (set by the runner, added to by
    scenarios of several steps)."""

    @property
    def victim_worker(self) -> str:
        return self.victim or self.cluster.worker_names[-1]

    async def pick_busiest(self) -> None:
        self.victim = await asyncio.to_thread(self.cluster.busiest_worker)


class _KillAndRestart(Scenario):
    """kill -9 the process group of `target()`; restart it with the same flags after `hold_s`."""

    def target(self) -> str:
        raise NotImplementedError

    async def inject(self, load: LoadGen) -> None:
        await asyncio.to_thread(self.cluster.signal_group, self.target(), signal.SIGKILL)

    async def heal(self) -> None:
        await asyncio.to_thread(self.cluster.restart, self.target())


class WorkerKill(_KillAndRestart):
    id = "worker-kill"
    fault = "kill -9 a worker mid-stream, restart it"

    async def inject(self, load: LoadGen) -> None:
        await self.pick_busiest()
        await super().inject(load)

    def target(self) -> str:
        return self.victim_worker

    def detected(self) -> bool | None:
        return self.cluster.any_router_marks_down(self.cluster.addresses[self.victim_worker])


class RouterKill(_KillAndRestart):
    id = "router-kill"
    fault = "kill -9 one router replica, restart it"

    def target(self) -> str:
        return self.cluster.router_names[0]


class TokenizerKill(_KillAndRestart):
    id = "tokenizer-kill"
    fault = "kill -9 the tokenizer, restart it"

    def target(self) -> str:
        return "tokenizer"

    def detected(self) -> bool | None:
        return not http_ok(f"{self.cluster.gateway_url}/health")


class GatewayKill(_KillAndRestart):
    id = "gateway-kill"
    fault = "kill -9 the gateway, restart it"

    @property
    def hold_s(self) -> float:
        return self.pace.hold_s(3.0, 1.0)

    def target(self) -> str:
        return "gateway"

    def detected(self) -> bool | None:
        return not http_ok(f"{self.cluster.gateway_url}/health")


class RedisRestart(_KillAndRestart):
    id = "redis-restart"
    fault = "kill -9 Redis, start it again (empty)"

    def target(self) -> str:
        return "redis"

    def detected(self) -> bool | None:
        """cache-aware routers fall back to approx-tree while Redis is away (other policies do not use it)."""
        policies = self.cluster.router_policies()
        if self.cluster.spec.policy != "cache-aware":
            return None
        return any(p != "cache-aware" for p in policies)


class WorkerStop(Scenario):
    id = "worker-stop"
    fault = "SIGSTOP a worker, SIGCONT after the hold"

    @property
    def hold_s(self) -> float:
        return self.pace.hold_s(10.0, 4.0)

    async def inject(self, load: LoadGen) -> None:
        await self.pick_busiest()
        await asyncio.to_thread(self.cluster.signal_group, self.victim_worker, signal.SIGSTOP)

    async def heal(self) -> None:
        await asyncio.to_thread(self.cluster.signal_group, self.victim_worker, signal.SIGCONT)

    def detected(self) -> bool | None:
        return self.cluster.any_router_marks_down(self.cluster.addresses[self.victim_worker])


class RollingRestart(Scenario):
    id = "rolling-restart"
    fault = "SIGTERM each worker in turn (drain), start it again, next once it is routed to"

    @property
    def hold_s(self) -> float:
        return 0.0

    async def inject(self, load: LoadGen) -> None:
        self.drain_s: list[float] = []
        for i, name in enumerate(self.cluster.worker_names):
            if i:
                self.fault_times.append(load.now_s())
            self.drain_s.append(round(await asyncio.to_thread(self.cluster.drain_restart, name), 2))

    def extra(self) -> dict[str, object]:
        return {"drain_s": getattr(self, "drain_s", [])}


class _Proxied(Scenario):
    """The load goes through a router that dials the victim worker through a FaultProxy."""

    mode: str = "pass"

    def __init__(self, cluster: FaultCluster, pace: Pace) -> None:
        super().__init__(cluster, pace)
        self.proxy = FaultProxy(cluster.addresses[self.victim_worker])

    async def setup(self) -> str:
        self.proxy.start()
        url, _ = await asyncio.to_thread(self.cluster.start_proxied_front, self.victim_worker, self.proxy.address)
        return url

    async def teardown(self) -> None:
        await asyncio.to_thread(self.cluster.stop_proxied_front)
        self.proxy.stop()

    async def inject(self, load: LoadGen) -> None:
        self.proxy.set_mode("delay" if self.mode == "delay" else "cut")

    async def heal(self) -> None:
        self.proxy.set_mode("pass")

    def detected(self) -> bool | None:
        if self.mode == "delay":
            return None
        return self.cluster.any_router_marks_down(self.proxy.address)


class ProxyDelay(_Proxied):
    id = "proxy-delay"
    fault = "+200 ms on every chunk between router and a worker"
    mode = "delay"

    @property
    def hold_s(self) -> float:
        return self.pace.hold_s(15.0, 5.0)


class ProxyCut(_Proxied):
    id = "proxy-cut"
    fault = "cut every router-worker connection (and refuse new ones)"
    mode = "cut"


class ClientDisconnect(Scenario):
    id = "client-disconnect"
    fault = "50 clients close their stream after 2 frames"
    num_clients = 50

    @property
    def hold_s(self) -> float:
        return 0.0

    async def inject(self, load: LoadGen) -> None:
        def aborting(i: int) -> RequestSpec:
            spec = chat_stream(10_000 + i, 64)
            return RequestSpec(spec.kind + "-abort", spec.path, spec.body, abort_after_frames=2)

        quitters = LoadGen(load.base_url, aborting, self.num_clients, self.num_clients, load.timeout_s)
        self.quitters = await quitters.run()


SCENARIOS: dict[str, Callable[[FaultCluster, Pace], Scenario]] = {
    cls.id: cls for cls in (WorkerKill, RollingRestart, RouterKill, TokenizerKill, GatewayKill, WorkerStop,
                            RedisRestart, ProxyDelay, ProxyCut, ClientDisconnect)
}
"""Scenario id -> class, in the order the full suite runs them."""
