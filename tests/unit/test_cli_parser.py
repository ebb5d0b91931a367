"""The `radixmesh` command line built for one command equals that command's part of the whole one."""

from __future__ import annotations

import argparse

import pytest

from radixmesh.cli import COMMANDS, build_parser


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _siblings(command: str) -> tuple[str, ...]:
    """The commands registered by the same function as `command`, in registry order."""
    return tuple(name for name in COMMANDS if COMMANDS[name] == COMMANDS[command])


@pytest.mark.parametrize("target", sorted(set(COMMANDS.values())))
def test_each_function_adds_the_commands_it_is_listed_with(target: str) -> None:
    name = next(n for n in COMMANDS if COMMANDS[n] == target)
    parser = argparse.ArgumentParser()
    COMMANDS.load(name)(parser.add_subparsers())
    assert tuple(_commands(parser)) == _siblings(name)


def test_the_whole_parser_has_every_command_in_registry_order() -> None:
    assert tuple(_commands(build_parser())) == COMMANDS.ids


@pytest.mark.parametrize("command", COMMANDS.ids)
def test_one_command_parser_has_that_command_with_the_same_flags(command: str) -> None:
    whole, alone = _commands(build_parser())[command], _commands(build_parser(command))
    assert tuple(alone) == _siblings(command)  # the commands its function adds, and no other
    assert alone[command].format_help() == whole.format_help()


@pytest.mark.parametrize("command", [None, "-h", "no-such-command"])
def test_anything_else_gets_the_whole_parser(command: str | None) -> None:
    assert set(_commands(build_parser(command))) == set(_commands(build_parser()))
