"""The layering of the package, checked on the import statements of every module (their AST, so imports inside
functions and under TYPE_CHECKING count too):

- the engine imports neither the CLI, nor `index/`, nor a service (gateway, router, worker, tokenizer, grammar
  service, cluster, lang);
- `common/` imports nothing of the engine (nor of a service);
- `wire/`, the vocabulary that crosses processes, imports only `common/`, `protocol/` and itself;
- the kernels import only themselves from this project.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services" / "radixmesh"
KERNELS = ROOT / "kernels" / "radixmesh" / "kernels"
SERVICE_PACKAGES = ("gateway", "router", "worker", "tokenizer_service", "grammar_service", "cluster", "lang")

RULES: dict[str, tuple[str, ...]] = {
    "radixmesh.engine": ("radixmesh.cli", "radixmesh.index", *(f"radixmesh.{p}" for p in SERVICE_PACKAGES)),
    "radixmesh.common": ("radixmesh.engine", "radixmesh.cli", "radixmesh.index",
                         *(f"radixmesh.{p}" for p in SERVICE_PACKAGES)),
}
"""Package -> the packages none of its modules may import."""
ONLY: dict[str, tuple[str, ...]] = {
    "radixmesh.wire": ("radixmesh.wire", "radixmesh.common", "radixmesh.protocol"),
    "radixmesh.kernels": ("radixmesh.kernels",),
}
"""Package -> the only packages of this project its modules may import."""


def module_name(path: Path) -> str:
    base = KERNELS.parents[1] if path.is_relative_to(KERNELS) else SERVICES.parent
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> Iterator[tuple[str, Path]]:
    for root in (SERVICES, KERNELS):
        for path in sorted(root.rglob("*.py")):
            name = module_name(path)
            if not within(name, "radixmesh.protocol"):
                yield name, path


def imported_modules(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """(module, line) for every import in `path`, relative imports resolved against module `name`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            yield base, node.lineno
            for alias in node.names:  # `from radixmesh import engine` imports radixmesh.engine
                yield f"{base}.{alias.name}", node.lineno


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(modules: Iterator[tuple[str, Path]]) -> list[str]:
    found = []
    for name, path in modules:
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for imported, line in imported_modules(name, path):
            if not within(imported, "radixmesh") or imported == "radixmesh":
                continue
            for package, forbidden in RULES.items():
                if within(name, package) and any(within(imported, f) for f in forbidden):
                    found.append(f"{where}:{line}: {package} imports {imported}")
            for package, allowed in ONLY.items():
                if within(name, package) and not any(within(imported, a) for a in allowed):
                    found.append(f"{where}:{line}: {package} imports {imported}")
    return found


def test_the_layers_import_only_downwards() -> None:
    assert violations(project_modules()) == []


def test_every_module_is_scanned() -> None:
    names = {name for name, _ in project_modules()}
    assert {"radixmesh.engine.scheduler.core", "radixmesh.wire.convert", "radixmesh.kernels.decode_attention",
            "radixmesh.common.registry", "radixmesh.cli"} <= names
    assert not any(within(n, "radixmesh.protocol") for n in names)  # generated code is not held to the rules


@pytest.mark.parametrize(("source", "module", "expected"), [
    ("from radixmesh.cli import main", "radixmesh.engine.x", "radixmesh.cli"),
    ("import radixmesh.index.reader", "radixmesh.engine.x", "radixmesh.index.reader"),
    ("def f():\n    from radixmesh.gateway import app", "radixmesh.engine.x", "radixmesh.gateway.app"),
    ("from ..router import disagg", "radixmesh.engine.x", "radixmesh.router.disagg"),
    ("from . import core", "radixmesh.engine.scheduler.x", "radixmesh.engine.scheduler.core"),
])
def test_imports_are_found_wherever_they_are(tmp_path: Path, source: str, module: str, expected: str) -> None:
    path = tmp_path / "x.py"
    path.write_text(source)
    assert expected in {m for m, _ in imported_modules(module, path)}


@pytest.mark.parametrize(("module", "source", "rule"), [
    ("radixmesh.engine.bad", "from radixmesh.cli import main", "radixmesh.engine imports radixmesh.cli.main"),
    ("radixmesh.common.bad", "import radixmesh.engine.scheduler", "radixmesh.common imports radixmesh.engine"),
    ("radixmesh.wire.bad", "from radixmesh.engine.request import Req", "radixmesh.wire imports radixmesh.engine"),
    ("radixmesh.kernels.bad", "from radixmesh.common.errors import invalid_argument",
     "radixmesh.kernels imports radixmesh.common"),
])
def test_a_forbidden_import_is_reported(tmp_path: Path, module: str, source: str, rule: str) -> None:
    path = tmp_path / "bad.py"
    path.write_text(source + "\n")
    found = violations(iter([(module, path)]))
    assert found and all(f.startswith(f"{path}:1: ") for f in found) and any(rule in f for f in found), found
