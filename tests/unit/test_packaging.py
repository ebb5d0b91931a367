"""pyproject.toml lists every package: a regular (non-editable) install, as the images do, ships them all."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for name, root in setuptools["package-dir"].items():
        for init in (REPO / root).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / root)
            package = ".".join([name, *relative.parts])
            if package.startswith("radixmesh.kernels") and name != "radixmesh.kernels":
                continue  # kernels/radixmesh/kernels is mapped on its own
            found.add(package)
    for init in (REPO / "loadtests").rglob("__init__.py"):
        found.add(".".join(init.parent.relative_to(REPO).parts))
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert listed - found == set(), f"pyproject.toml lists packages that do not exist: {sorted(listed - found)}"


def test_every_module_path_says_its_import_name() -> None:
    """A file's path under services/ or kernels/ is its import path: radixmesh/engine/scheduler/core.py is
    radixmesh.engine.scheduler.core, so a reader (or a tool following imports by path) finds it."""
    tomllib = pytest.importorskip("tomllib")
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, root in package_dir.items():
        assert root.endswith("/".join(name.split("."))), f"{name} maps to {root}, a path that does not say its name"
    for top in ("services", "kernels"):
        stray = [p.name for p in (REPO / top).iterdir() if p.name not in ("radixmesh", "__pycache__")]
        assert stray == [], f"{top}/ holds {stray} outside radixmesh/: move it under the path of its import name"
