"""The `radixmesh` command line built for one command equals that command's part of the whole one."""

from __future__ import annotations

import argparse
import importlib

import pytest

from radixmesh.cli import EXTERNAL_COMMANDS, build_parser


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("target", sorted(EXTERNAL_COMMANDS))
def test_each_module_adds_the_commands_it_is_listed_with(target: str) -> None:
    module, _, func = target.partition(":")
    parser = argparse.ArgumentParser()
    getattr(importlib.import_module(module), func)(parser.add_subparsers())
    assert tuple(_commands(parser)) == EXTERNAL_COMMANDS[target]


def test_the_whole_parser_has_every_command() -> None:
    listed = {name for names in EXTERNAL_COMMANDS.values() for name in names}
    assert set(_commands(build_parser())) == {"generate", *listed}


@pytest.mark.parametrize("command", ["generate", *sorted({n for names in EXTERNAL_COMMANDS.values() for n in names})])
def test_one_command_parser_has_that_command_with_the_same_flags(command: str) -> None:
    whole, alone = _commands(build_parser())[command], _commands(build_parser(command))
    siblings = next((names for names in EXTERNAL_COMMANDS.values() if command in names), (command,))
    assert tuple(alone) == siblings  # the commands its module adds, and no other
    assert alone[command].format_help() == whole.format_help()


@pytest.mark.parametrize("command", [None, "-h", "no-such-command"])
def test_anything_else_gets_the_whole_parser(command: str | None) -> None:
    assert set(_commands(build_parser(command))) == set(_commands(build_parser()))
