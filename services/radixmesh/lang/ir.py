"""The expressions a program appends to its state: text, `gen`, `select` and role blocks.

`s += expr` never runs anything by itself: the state queues the expression and its
executor thread runs it in order, so that independent states (the branches of a fork)
make their LLM calls concurrently.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from radixmesh.common.errors import invalid_argument

ROLES = ("system", "user", "assistant")


class Expr:
    """Something a program can append to its state; `+` concatenates expressions and strings."""

    def __add__(self, other: Expr | str) -> Concat:
        return Concat((self, as_expr(other)))

    def __radd__(self, other: Expr | str) -> Concat:
        return Concat((as_expr(other), self))


@dataclass(frozen=True, eq=False)
class Text(Expr):
    text: str


@dataclass(frozen=True, eq=False)
class Concat(Expr):
    parts: tuple[Expr, ...]


@dataclass(frozen=True)
class GenParams:
    """Sampling options of one `gen`; None means the program's default, else the server's."""

    max_tokens: int | None = None
    """Most tokens to generate."""
    stop: str | tuple[str, ...] | None = None
    """Stop strings; the output ends before the first one (which is not included)."""
    temperature: float | None = None
    """0 is greedy."""
    top_p: float | None = None
    """Nucleus mass in (0, 1]."""
    top_k: int | None = None
    """Keep the k most likely tokens (-1: all)."""
    min_p: float | None = None
    """Drop tokens under min_p times the top probability."""
    frequency_penalty: float | None = None
    """Subtracted per earlier occurrence in the output."""
    presence_penalty: float | None = None
    """Subtracted once for tokens already in the output."""
    ignore_eos: bool | None = None
    """Keep generating past the end-of-sequence token."""
    seed: int | None = None
    """Same seed, same prompt: same output."""
    regex: str | None = None
    """Constrain the output to match this regular expression."""
    json_schema: str | None = None
    """Constrain the output to JSON matching this schema (JSON text)."""

    def merged_over(self, defaults: GenParams) -> GenParams:
        """These options, with unset ones taken from `defaults`."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in values.items():
            if value is None:
                values[name] = getattr(defaults, name)
        return GenParams(**values)

    def to_wire(self) -> dict[str, Any]:
        """SGLang-native `sampling_params`: only the options that are set."""
        wire: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            key = "max_new_tokens" if f.name == "max_tokens" else f.name
            wire[key] = list(value) if isinstance(value, tuple) else value
        return wire


@dataclass(frozen=True, eq=False)
class Gen(Expr):
    """Generate text at the end of the state; stored under `name` when it has one."""

    name: str | None
    params: GenParams


@dataclass(frozen=True, eq=False)
class Select(Expr):
    """Append the choice the model finds most likely after the state's text; stored under `name`."""

    name: str | None
    choices: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True, eq=False)
class RoleEnd(Expr):
    role: str


def as_expr(value: Expr | str) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"a program state takes strings and gen/select/role expressions, not {type(value).__name__}")


# ---- constructors used in programs ---------------------------------------------------------------
def gen(name: str | None = None, *, max_tokens: int | None = None, stop: str | Sequence[str] | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None, presence_penalty: float | None = None,
        ignore_eos: bool | None = None, seed: int | None = None, regex: str | None = None,
        json_schema: str | dict[str, Any] | None = None) -> Gen:
    """Generate text; `s[name]` reads it. `json_schema` may be a dict or JSON text."""
    if regex is not None and json_schema is not None:
        raise invalid_argument("give at most one of regex and json_schema", "regex")
    if max_tokens is not None and max_tokens < 1:
        raise invalid_argument(f"max_tokens must be >= 1 (got {max_tokens})", "max_tokens")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if stop is not None else None
    schema = json.dumps(json_schema) if isinstance(json_schema, dict) else json_schema
    return Gen(name, GenParams(max_tokens, stops, temperature, top_p, top_k, min_p, frequency_penalty,
                               presence_penalty, ignore_eos, seed, regex, schema))


def select(name: str | None = None, *, choices: Sequence[str]) -> Select:
    """Pick the choice with the highest total log-probability under the model; `s[name]` reads it."""
    if not choices or any(not isinstance(c, str) or not c for c in choices):
        raise invalid_argument("select needs a non-empty list of non-empty strings", "choices")
    return Select(name, tuple(choices))


def _role(role: str, content: Expr | str) -> Expr:
    return Concat((RoleBegin(role), as_expr(content), RoleEnd(role)))


def system(content: Expr | str) -> Expr:
    """A system message in the model's chat template."""
    return _role("system", content)


def user(content: Expr | str) -> Expr:
    """A user message in the model's chat template."""
    return _role("user", content)


def assistant(content: Expr | str) -> Expr:
    """An assistant message in the model's chat template; put `gen` inside to have the model write it."""
    return _role("assistant", content)
