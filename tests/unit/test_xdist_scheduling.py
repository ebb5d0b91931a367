"""The order and units in which pytest-xdist workers get the suite (tests/xdist_scheduling.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from tests.xdist_scheduling import order_for_workers, unit_of


@dataclass
class FakeItem:
    nodeid: str
    markers: tuple[str, ...] = field(default=())

    def get_closest_marker(self, name: str) -> Any:
        return name if name in self.markers else None


def test_a_module_is_a_unit_and_the_k8s_tests_are_one():
    assert unit_of("tests/unit/test_a.py::test_x[1-2]") == "tests/unit/test_a.py"
    assert unit_of("tests/unit/test_a.py::TestGroup::test_x") == "tests/unit/test_a.py"
    assert unit_of("tests/k8s/test_chart_examples.py::test_y") == unit_of("tests/k8s/test_discovery.py::test_z")


def test_units_holding_slow_tests_go_first_then_process_tests_and_each_unit_stays_together():
    items = [
        FakeItem("tests/helm/test_h.py::a"),
        FakeItem("tests/integration/test_i.py::a", ("integration",)),
        FakeItem("tests/integration/test_i.py::b", ("integration",)),
        FakeItem("tests/k8s/test_k.py::a", ("k8s",)),
        FakeItem("tests/k8s/test_l.py::a", ("k8s",)),
        FakeItem("tests/unit/test_fast.py::a"),
        FakeItem("tests/unit/test_spec.py::a"),
        FakeItem("tests/unit/test_spec.py::b", ("slow",)),
        FakeItem("tests/unit/test_spec.py::c"),
    ]
    order_for_workers(cast(list[pytest.Item], items))
    assert [item.nodeid for item in items] == [
        "tests/unit/test_spec.py::a", "tests/unit/test_spec.py::b", "tests/unit/test_spec.py::c",
        "tests/integration/test_i.py::a", "tests/integration/test_i.py::b",
        "tests/k8s/test_k.py::a", "tests/k8s/test_l.py::a",
        "tests/helm/test_h.py::a", "tests/unit/test_fast.py::a",
    ]
