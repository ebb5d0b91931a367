"""The tool-call parser contract, and the plain data that crosses it.

A parser knows one model family's tool-call syntax in both directions: it reads calls out of the
model's text (`scan`), describes the syntax for constrained decoding (`syntax`), and writes calls,
tool results and the tool list as text for chat templates that do not render tools themselves.
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from radixmesh.gateway.tools.json_scan import Memo


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call (a validated entry of the request's `tools`)."""

    name: str
    """[A-Za-z0-9_-]{1,64}, unique within the request."""
    description: str = ""
    """What the function does, for the model."""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    """JSON Schema of the arguments object."""

    def openai(self) -> dict[str, Any]:
        """OpenAI's chat `tools` entry (what chat templates read)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made, or made earlier in the conversation."""

    id: str
    name: str
    arguments: str
    """JSON text (an object when the model wrote one)."""


@dataclass
class ParsedCall:
    """A call read from the output so far; `arguments` only ever grows while the output does."""

    name: str
    arguments: str
    complete: bool


@dataclass
class Scan:
    """What the output text holds so far. `content` (the text outside calls) and each call's arguments only
    grow as the text grows: a parser holds back whatever it cannot settle yet (the start of a marker)."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


@dataclass(frozen=True)
class CallSyntax:
    """How calls are written, for building a grammar: each call is `begin(name)` + arguments object + `end`,
    calls are joined by `separator`, and the list is wrapped in `prefix` ... `suffix`."""

    begin: str
    """The text before the arguments object, with NAME where the function's name goes (JSON-escaped)."""
    end: str
    """The text after the arguments object."""
    separator: str
    prefix: str = ""
    suffix: str = ""
    trigger: str = ""
    """Free text may precede calls, which start with this text; "" when calls only come first."""

    def call_begin(self, name: str) -> str:
        return self.begin.replace("NAME", json.dumps(name)[1:-1])


class ToolCallParser(abc.ABC):
    """One tool-call syntax. `scan` is called on the whole output text each time it grows (and once more
    with `final`); it must keep `Scan`'s growth promise, which the streaming deltas rely on."""

    id: ClassVar[str]
    """Registry id (kebab-case), as in --tool-call-parser."""
    keeps_special_tokens: ClassVar[bool] = False
    """The syntax starts with a special token (Mistral's [TOOL_CALLS]): decode with special tokens kept."""

    @abc.abstractmethod
    def scan(self, text: str, final: bool, memo: Memo | None = None) -> Scan:
        """Content and calls of the output so far; `final`: the output is complete (release held-back text).
        `memo`: the stream's scanning memo (json_scan.Memo), so that a growing text is not read again."""

    @property
    @abc.abstractmethod
    def syntax(self) -> CallSyntax:
        """The syntax, for constrained decoding."""

    @abc.abstractmethod
    def write_calls(self, calls: list[ToolCall]) -> str:
        """Earlier calls as the model writes them (an assistant turn, for templates without tools)."""

    @abc.abstractmethod
    def instructions(self, tools: list[ToolSpec]) -> str:
        """A system-prompt block listing the tools and how to call them (for templates without tools)."""

    def write_result(self, call_id: str, name: str, content: str) -> str:
        """A tool's result, as a user turn's text (for templates without tools)."""
        label = f"{name} ({call_id})" if name else call_id
        return f"Result of {label}:\n{content}"


def tool_list_json(tools: list[ToolSpec]) -> str:
    """The tools, one OpenAI-shaped JSON object per line."""
    return "\n".join(json.dumps(tool.openai(), ensure_ascii=False) for tool in tools)


def call_object(call: ToolCall, arguments_key: str = "arguments") -> str:
    """`{"name": ..., "arguments": ...}` with the arguments' JSON text as it is."""
    return f'{{"name": {json.dumps(call.name, ensure_ascii=False)}, "{arguments_key}": {call.arguments or "{}"}}}'


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` are the start of `marker` (and may become it)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
