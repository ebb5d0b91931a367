"""How `pytest -n N` (pytest-xdist) shares the suite between its worker processes.

A test module is one unit of work, so a module-scoped fixture (a cluster, a Redis, a bench run) starts once, in
one worker; the k8s tests are one unit together, so one control plane serves them all. Units are handed out in
the order the workers collected them, and `order_for_workers` puts the long ones first: modules holding a
`slow` test, then the other modules that start processes (`integration`, `k8s`), then the rest. The many short
modules at the end fill both workers up evenly instead of one worker finishing a long module alone.
"""

from __future__ import annotations

from typing import Any

import pytest

K8S_TIMINGS = "k8s timings"
"""The user property in which the k8s tests report the seconds of the steps they time (tests/k8s/conftest.py):
a worker's reports reach the main process, its globals do not, so tests/conftest.py prints them from there."""

SHARED_UNITS = ("tests/k8s/",)
"""Directories whose tests form one unit of work together (they share a session-scoped fixture)."""


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its directory in SHARED_UNITS, else its module."""
    for prefix in SHARED_UNITS:
        if nodeid.startswith(prefix):
            return prefix.rstrip("/")
    return nodeid.split("::", 1)[0]


def _rank(item: pytest.Item) -> int:
    """0 for a slow test, 1 for one that starts processes, 2 for the rest."""
    if item.get_closest_marker("slow") is not None:
        return 0
    if any(item.get_closest_marker(m) is not None for m in ("integration", "k8s")):
        return 1
    return 2


def order_for_workers(items: list[pytest.Item]) -> None:
    """Sorts `items` in place by their unit's rank (its lowest test's), keeping each unit's tests together and
    in their collected order."""
    rank: dict[str, int] = {}
    for item in items:
        unit = unit_of(item.nodeid)
        rank[unit] = min(rank.get(unit, 2), _rank(item))
    position = {unit: i for i, unit in enumerate(dict.fromkeys(unit_of(item.nodeid) for item in items))}
    items.sort(key=lambda item: (rank[unit_of(item.nodeid)], position[unit_of(item.nodeid)]))


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduler with units from `unit_of`, handed out in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False
    return UnitScheduling(config, log)
