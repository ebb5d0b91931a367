"""Readiness of a service from the states of its named dependencies.

Every radixmesh process starts and listens whatever else is up; it is *ready* once every
required dependency answers, and says which one it waits for while it is not:

    readiness = Readiness("gateway")
    readiness.add("router", "the router at 10.0.0.5:50053")
    readiness.set("router", False, "not reachable: connection refused")
    readiness.reason  # "waiting for the router at 10.0.0.5:50053 (not reachable: connection refused)"

An optional dependency (a worker's KV-index Redis) never makes the service unready; while it is
down the service is `degraded` and says so. Each state change is logged once, and listeners
(the gRPC health status, a metric) are called on every change of readiness.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass
class Dependency:
    """One thing a service needs (required) or uses when it is there (optional)."""

    name: str
    """Short id: router, tokenizer, workers, redis, engine, ..."""
    description: str
    """What it is, as a message names it: "the router at host:port"."""
    required: bool = True
    """Required: the service is not ready without it. Optional: only degraded."""
    up: bool = False
    """Whether it answers now."""
    detail: str = "not contacted yet"
    """Why it is down (or a note while up)."""


Listener = Callable[["Readiness"], None]


class Readiness:
    """The dependencies of one service and whether, all told, it is ready."""

    def __init__(self, service: str) -> None:
        self.service = service
        self._deps: dict[str, Dependency] = {}
        self._listeners: list[Listener] = []

    def add(self, name: str, description: str, required: bool = True, up: bool = False,
            detail: str = "not contacted yet") -> Dependency:
        """Declare a dependency (again: replaces it)."""
        dep = Dependency(name, description, required, up, "" if up else detail)
        self._deps[name] = dep
        self._notify()
        return dep

    def remove(self, name: str) -> None:
        if self._deps.pop(name, None) is not None:
            self._notify()

    def get(self, name: str) -> Dependency:
        return self._deps[name]

    def __contains__(self, name: str) -> bool:
        return name in self._deps

    @property
    def dependencies(self) -> list[Dependency]:
        return list(self._deps.values())

    def set(self, name: str, up: bool, detail: str = "") -> bool:
        """Record a dependency's state; returns True when its up/down state changed (logged once per change)."""
        dep = self._deps[name]
        changed = dep.up != up
        dep.up, dep.detail = up, detail
        if changed:
            if up:
                logger.warning("%s: %s answers%s", self.service, dep.description, f" ({detail})" if detail else "")
            else:
                logger.warning("%s: %s is %s: %s", self.service, dep.description,
                               "unavailable" if dep.required else "unavailable (degraded)", detail or "down")
            self._notify()
        return changed

    @property
    def ready(self) -> bool:
        """Every required dependency is up."""
        return all(dep.up for dep in self._deps.values() if dep.required)

    @property
    def degraded(self) -> list[Dependency]:
        """Optional dependencies that are down now."""
        return [dep for dep in self._deps.values() if not dep.required and not dep.up]

    @property
    def reason(self) -> str:
        """"" when ready; else what it waits for: "waiting for <description> (<detail>); ..."."""
        return "; ".join(_waiting(dep) for dep in self._deps.values() if dep.required and not dep.up)

    def summary(self) -> str:
        """One line for logs and status replies: ready, degraded, or the reason."""
        if not self.ready:
            return f"not ready: {self.reason}"
        if self.degraded:
            return "ready, degraded: " + "; ".join(f"{d.description} unavailable ({d.detail or 'down'})"
                                                   for d in self.degraded)
        return "ready"

    def on_change(self, listener: Listener) -> None:
        """Call `listener(self)` on every change of a dependency's up/down state (and now)."""
        self._listeners.append(listener)
        listener(self)

    def _notify(self) -> None:
        for listener in self._listeners:
            listener(self)


def _waiting(dep: Dependency) -> str:
    return f"waiting for {dep.description}" + (f" ({dep.detail})" if dep.detail else "")
