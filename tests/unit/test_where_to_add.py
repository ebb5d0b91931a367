"""The README's "Where to add X" table stays true: every registry it names is a LazyRegistry in the module it
names, every base class exists, and a model is the two files it says."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from radixmesh.common.registry import LazyRegistry

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def table_rows() -> list[list[str]]:
    section = README.split("## Where to add X", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[1:]]


def module_of(path: str) -> str:
    """`engine/models/registry.py` (under services/radixmesh unless it says otherwise) -> its import name."""
    path = path.removeprefix("services/")
    if path.startswith("loadtests/"):
        return path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    if not path.startswith("radixmesh/"):
        path = "radixmesh/" + path
    return path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def test_the_table_covers_the_issue_s_list() -> None:
    things = [row[0] for row in table_rows()]
    for thing in ("a model", "a routing policy", "a KV transport", "a kernel", "a speculative proposer",
                  "an attention backend", "a benchmark"):
        assert thing in things, thing


@pytest.mark.parametrize("row", table_rows(), ids=lambda row: row[0])
def test_each_registry_named_is_a_lazy_registry_where_the_table_says(row: list[str]) -> None:
    register = row[2]
    for name, path in re.findall(r"`([A-Z_]+)` in `([\w/.]+\.py)`", register):
        registry = getattr(importlib.import_module(module_of(path)), name)
        assert isinstance(registry, LazyRegistry), f"{name} in {path}"


@pytest.mark.parametrize("row", table_rows(), ids=lambda row: row[0])
def test_each_base_class_named_exists(row: list[str]) -> None:
    for cls, path in re.findall(r"a `([A-Z]\w+)` \(`([\w/.]+\.py)`\)", row[1]):
        guess = path if "/" in path and not path.startswith(("base.py", "hooks.py")) else None
        candidates = [guess] if guess else []
        for prefix in ("engine/attention/", "engine/speculative/", "engine/disagg/transport/", "router/policies/",
                       "engine/quant/", "engine/scheduler/", "loadtests/workloads/"):
            candidates.append(prefix + path.split("/")[-1])
        found = False
        for candidate in candidates:
            try:
                module = importlib.import_module(module_of(candidate))
            except ModuleNotFoundError:
                continue
            found = found or hasattr(module, cls)
        assert found, f"{cls} ({path})"


def test_a_model_is_its_module_and_one_family_entry() -> None:
    row = next(r for r in table_rows() if r[0] == "a model")
    assert "engine/models/<name>.py" in row[1] and "engine/models/registry.py" in row[2]
    from radixmesh.engine.models.registry import FAMILIES

    for family in FAMILIES:  # every family's class sits in a module of engine/models/
        module = family.model.partition(":")[0]
        assert module.startswith("radixmesh.engine.models."), family.id
        path = REPO / "services" / (module.replace(".", "/") + ".py")
        assert path.is_file(), path
