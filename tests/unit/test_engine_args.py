"""The engine's flags (engine/args.py): one per EngineConfig field with the field's docstring as help, typed as the
field, parsed back into the config's keyword arguments; the engine owns them (the CLI and the services import
them from it)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import pytest

from radixmesh.engine.args import _SKIP_FLAGS, MODEL_FLAGS, add_engine_args, engine_kwargs, field_docs
from radixmesh.engine.config import EngineConfig


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class Documented:
    plain: int = 1
    """The plain field."""
    percent: float = 0.5
    """Share of memory, 50% by default."""
    undocumented: str = ""


def test_field_docs_are_the_docstrings_under_the_fields() -> None:
    docs = field_docs(Documented)
    assert docs == {"plain": "The plain field.", "percent": "Share of memory, 50%% by default."}  # argparse-safe
    assert field_docs(Documented) is docs  # parsed once per class


def test_every_engine_field_has_a_documented_flag() -> None:
    actions = {option: a for a in parser()._actions for option in a.option_strings}
    docs = field_docs(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        if field.name in _SKIP_FLAGS - set(MODEL_FLAGS):
            continue
        assert flag_of(field.name) in actions, field.name
        if field.name not in MODEL_FLAGS:
            assert actions[flag_of(field.name)].help == docs.get(field.name, ""), field.name
            assert docs.get(field.name), f"EngineConfig.{field.name} has no docstring"


def test_defaults_parse_back_to_the_configs_defaults() -> None:
    kwargs = engine_kwargs(parser().parse_args([]))
    config = EngineConfig(**kwargs)
    for field in dataclasses.fields(EngineConfig):
        if field.name in kwargs and field.name not in MODEL_FLAGS and field.name != "log_level":
            assert getattr(config, field.name) == field.default, field.name


@pytest.mark.parametrize(("argv", "expected"), [
    (["--max-running-requests", "7"], {"max_running_requests": 7}),
    (["--mem-fraction-static", "0.5"], {"mem_fraction_static": 0.5}),
    (["--disable-radix-cache"], {"disable_radix_cache": True}),
    (["--schedule-policy", "fcfs"], {"schedule_policy": "fcfs"}),
    (["--disable-overlap-schedule"], {"overlap_schedule": "off"}),
    (["--max-total-tokens", "1000"], {"max_total_tokens": 1000}),
    (["--context-length", "512", "--dtype", "bfloat16"], {"context_length": 512, "dtype": "bfloat16"}),
])
def test_flags_parse_into_config_keywords(argv: list[str], expected: dict[str, object]) -> None:
    kwargs = engine_kwargs(parser().parse_args(argv))
    for name, value in expected.items():
        assert kwargs[name] == value, name
    EngineConfig(**kwargs)  # and the config takes them


def test_booleans_are_switches_and_bad_numbers_are_refused() -> None:
    p = parser()
    assert engine_kwargs(p.parse_args([]))["disable_cuda_graph"] is False
    assert engine_kwargs(p.parse_args(["--disable-cuda-graph"]))["disable_cuda_graph"] is True
    with pytest.raises(SystemExit):
        p.parse_args(["--max-running-requests", "many"])


def test_only_config_fields_are_passed_on() -> None:
    namespace = parser().parse_args([])
    namespace.not_a_field = 1
    assert set(engine_kwargs(namespace)) <= set(EngineConfig.field_names())
