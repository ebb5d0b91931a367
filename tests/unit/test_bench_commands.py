"""`radixmesh bench`: every registered benchmark adds exactly the subcommand it is listed as, and the help lists
them by group with the micro-benchmarks beside them."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys

import pytest

from loadtests.commands import BENCH_COMMANDS, GROUPS, MODULE_BENCHMARKS, bench_listing
from radixmesh.cli import build_parser


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("name", BENCH_COMMANDS.ids)
def test_each_benchmark_adds_the_subcommand_it_is_listed_as(name: str) -> None:
    parser = argparse.ArgumentParser()
    BENCH_COMMANDS.load(name)(parser.add_subparsers())
    assert list(subcommands(parser)) == [name]
    assert subcommands(parser)[name].description or subcommands(parser)[name].format_usage()


def test_the_groups_list_every_benchmark_once_in_registry_order() -> None:
    listed = [name for names in GROUPS.values() for name in names]
    assert listed == list(BENCH_COMMANDS.ids)


def test_the_micro_benchmarks_are_modules_that_exist() -> None:
    for module in MODULE_BENCHMARKS:
        assert importlib.util.find_spec(module) is not None, module


def test_bench_help_lists_what_it_has() -> None:
    bench = subcommands(build_parser("bench"))["bench"]
    text = bench.format_help()
    for name in BENCH_COMMANDS.ids:
        assert name in text, name
    for group in GROUPS:
        assert f"{group}:" in text
    for module in MODULE_BENCHMARKS:
        assert module in text
    assert bench_listing() in text


def test_bench_help_from_the_command_line() -> None:
    result = subprocess.run([sys.executable, "-m", "radixmesh.cli", "bench", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "engine (in-process): one-batch, offline" in result.stdout
    assert "python -m MODULE --help" in result.stdout
