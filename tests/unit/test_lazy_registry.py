"""The one lazy registry (common/registry.py) and every plug-in point built on it: ids listed without importing
anything, unknown ids refused by name, targets imported once, plug-ins added at run time."""

from __future__ import annotations

import subprocess
import sys

import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.common.registry import LazyRegistry

REGISTRIES = [
    ("radixmesh.engine.attention.registry", "ATTENTION_BACKENDS", "attention backend"),
    ("radixmesh.engine.grammar.registry", "GRAMMAR_BACKENDS", "grammar backend"),
    ("radixmesh.engine.models.registry", "MODEL_CLASSES", "model family"),
    ("radixmesh.engine.quant.registry", "QUANT_METHODS", "quantization"),
    ("radixmesh.engine.speculative.registry", "PROPOSERS", "speculative algorithm"),
    ("radixmesh.engine.disagg.transport.registry", "KV_TRANSPORTS", "KV transport"),
    ("radixmesh.router.policies", "ROUTING_POLICIES", "policy"),
    ("loadtests.workloads", "WORKLOADS", "workload"),
    ("radixmesh.engine.scheduler.hooks", "SCHEDULER_HOOKS", "scheduler hook"),
    ("radixmesh.gateway.tools.registry", "TOOL_PARSERS", "tool-call parser"),
    ("radixmesh.gateway.reasoning", "REASONING_PARSERS", "reasoning parser"),
    ("radixmesh.cli", "COMMANDS", "command"),
    ("loadtests.commands", "BENCH_COMMANDS", "bench command"),
]
"""Every plug-in point: (module, registry, kind)."""


def registry_of(module: str, name: str) -> LazyRegistry[object]:
    import importlib

    registry = getattr(importlib.import_module(module), name)
    assert isinstance(registry, LazyRegistry), f"{module}.{name} is not a LazyRegistry"
    return registry


def test_ids_come_in_order_and_nothing_is_imported_until_asked() -> None:
    registry: LazyRegistry[object] = LazyRegistry("thing", {"b-one": "json:dumps", "a-two": "json:loads"})
    assert registry.ids == ("b-one", "a-two") and list(registry) == ["b-one", "a-two"] and len(registry) == 2
    assert sorted(registry) == ["a-two", "b-one"] and "a-two" in registry and "nope" not in registry
    assert 3 not in registry and registry["a-two"] == "json:loads" and registry.target("b-one") == "json:dumps"
    import json

    assert registry.load("a-two") is json.loads and registry.create("b-one", [1]) == "[1]"


def test_an_unknown_id_is_the_registrys_error_naming_the_known_ones() -> None:
    registry: LazyRegistry[object] = LazyRegistry("widget", {"x": "json:dumps", "y": "json:loads"}, param="widget")
    with pytest.raises(RadixMeshError) as info:
        registry.load("z")
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and info.value.param == "widget"
    assert info.value.message == "unknown widget 'z' (known: x, y)"
    with pytest.raises(RadixMeshError):
        registry.check("z")
    plain: LazyRegistry[object] = LazyRegistry("w", {"x": "json:dumps"}, error=lambda m, p: ValueError(m))
    with pytest.raises(ValueError, match="unknown w 'q'"):
        plain.target("q")


def test_underscores_may_spell_dashes() -> None:
    registry: LazyRegistry[object] = LazyRegistry("b", {"torch-native": "json:dumps"}, dashes_for_underscores=True)
    assert "torch_native" in registry and registry.target("torch_native") == "json:dumps"
    strict: LazyRegistry[object] = LazyRegistry("b", {"torch-native": "json:dumps"})
    assert "torch_native" not in strict


def test_a_target_is_imported_once_and_replaced_targets_are_imported_again() -> None:
    registry: LazyRegistry[object] = LazyRegistry("t", {"x": "json:dumps"})
    first = registry.load("x")
    assert registry.load("x") is first
    registry["x"] = "json:loads"
    import json

    assert registry.load("x") is json.loads
    del registry["x"]
    assert "x" not in registry


def test_targets_must_name_an_attribute() -> None:
    with pytest.raises(AssertionError, match="module:attribute"):
        LazyRegistry("t", {"x": "json"})
    registry: LazyRegistry[object] = LazyRegistry("t", {})
    with pytest.raises(AssertionError):
        registry["y"] = "json.dumps"


def test_a_plug_in_added_with_monkeypatch_is_gone_afterwards(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixmesh.engine.speculative.registry import PROPOSERS

    before = PROPOSERS.ids
    monkeypatch.setitem(PROPOSERS, "oracle", "tests.unit.spec_factory:OracleProposer")
    assert "oracle" in PROPOSERS
    monkeypatch.undo()
    assert PROPOSERS.ids == before


@pytest.mark.parametrize(("module", "name", "kind"), REGISTRIES)
def test_every_plug_in_point_is_a_lazy_registry_whose_targets_import(module: str, name: str, kind: str) -> None:
    registry = registry_of(module, name)
    assert registry.kind == kind and len(registry) >= 1
    for entry_id in registry:
        if name not in ("COMMANDS", "BENCH_COMMANDS"):
            assert entry_id == entry_id.lower() and " " not in entry_id, entry_id
        target = registry[entry_id]
        module_name, _, attr = target.partition(":")
        __import__(module_name)
        assert hasattr(sys.modules[module_name], attr), f"{kind} {entry_id!r}: {target} does not exist"


def test_plug_in_ids_are_kebab_case() -> None:
    for module, name, _ in REGISTRIES:
        if name in ("MODEL_CLASSES",):
            continue  # family ids follow Hugging Face's model_type spelling (qwen2_vl)
        for entry_id in registry_of(module, name):
            assert "_" not in entry_id, f"{module}.{name}: {entry_id!r} is not kebab-case"


def test_listing_ids_imports_no_implementation() -> None:
    """A fresh interpreter lists every registry's ids without importing torch (the CLI starts fast)."""
    code = ("import sys\n"
            "from radixmesh.engine.attention.registry import ATTENTION_BACKENDS as a\n"
            "from radixmesh.engine.disagg.transport.registry import KV_TRANSPORTS as t\n"
            "from radixmesh.router.policies import ROUTING_POLICIES as p\n"
            "from radixmesh.engine.models.registry import FAMILIES as f\n"
            "print(a.ids, t.ids, p.ids, [x.id for x in f])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "assert 'radixmesh.engine.attention.triton_backend' not in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "triton" in result.stdout and "cache-aware" in result.stdout and "qwen2_vl" in result.stdout
