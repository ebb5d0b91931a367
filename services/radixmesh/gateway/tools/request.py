"""A request's `tools`, `tool_choice` and tool turns, checked: every malformed input a 400 naming its field."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.grammar.registry import check_grammar_syntax
from radixmesh.engine.grammar.spec import GrammarSpec
from radixmesh.gateway.tools.base import ToolCall, ToolSpec

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""OpenAI's rule for function names."""
MAX_TOOLS = 128
CHOICE_MODES = ("auto", "none", "required")


@dataclass(frozen=True)
class ToolRequest:
    """What a request asks of tools: the functions and how the model must use them."""

    tools: list[ToolSpec]
    choice: str
    """auto | required | the name of one tool ("none" never reaches here: such a request has no ToolRequest)."""
    parallel: bool = True
    """Several calls may come in one answer."""

    @property
    def constrained(self) -> bool:
        """Decoding must produce calls (required or a named function)."""
        return self.choice != "auto"


def tool_spec(name: Any, description: Any, parameters: Any, where: str, param: str = "tools") -> ToolSpec:
    """One function definition, checked; `where` names it in errors ("tools[0].function")."""
    if not isinstance(name, str):
        raise invalid_argument(f"{where}.name must be a string", param)
    if not NAME_PATTERN.fullmatch(name):
        raise invalid_argument(f"{where}.name {name!r} must be 1 to 64 letters, digits, '_' or '-'", param)
    if description is not None and not isinstance(description, str):
        raise invalid_argument(f"{where}.description must be a string", param)
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise invalid_argument(f"{where}.parameters must be a JSON Schema object", param)
    if parameters.get("type", "object") != "object":
        raise invalid_argument(f"{where}.parameters must describe an object (type 'object'), got type "
                               f"{parameters.get('type')!r}", param)
    try:
        check_grammar_syntax(GrammarSpec.parse("json_schema", json.dumps(parameters)))
    except Exception as exc:
        message = getattr(exc, "message", str(exc)).replace("json_schema", f"{where}.parameters")
        raise invalid_argument(message, param) from None
    return ToolSpec(name, description or "", parameters)


def check_tools(tools: list[ToolSpec], param: str = "tools") -> None:
    if len(tools) > MAX_TOOLS:
        raise invalid_argument(f"{param} has {len(tools)} functions; at most {MAX_TOOLS} are allowed", param)
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise invalid_argument(f"{param} names the function {tool.name!r} twice", param)
        seen.add(tool.name)


def named_choice(value: dict[str, Any], param: str = "tool_choice", nested: bool = True) -> str:
    """The function a named choice names: `{"type": "function", "function": {"name": ...}}` (chat) or, with
    `nested` false, `{"type": "function", "name": ...}` (Responses)."""
    if value.get("type") != "function":
        raise invalid_argument(f"{param}.type must be 'function' (got {value.get('type')!r})", param)
    holder = value.get("function") if nested else value
    where = f"{param}.function" if nested else param
    if not isinstance(holder, dict):
        raise invalid_argument(f"{where} must be an object with the function's name", param)
    name = holder.get("name")
    if not isinstance(name, str):
        raise invalid_argument(f"{where}.name must be a string", param)
    return name


def tool_choice(value: str | None, named: str | None, tools: list[ToolSpec], param: str = "tool_choice") -> str:
    """The choice as "auto" | "none" | "required" | a tool's name. `value`: the mode string (None when
    absent or named); `named`: the function a named choice names."""
    if named is not None:
        if not tools:
            raise invalid_argument(f"{param} names the function {named!r}, but the request has no tools", param)
        if named not in {tool.name for tool in tools}:
            known = ", ".join(tool.name for tool in tools)
            raise invalid_argument(f"{param} names the function {named!r}, which is not in tools ({known})", param)
        return named
    if value is None:
        return "auto" if tools else "none"
    if value not in CHOICE_MODES:
        raise invalid_argument(f"unknown {param} {value!r}: use auto, none, required or "
                               '{"type": "function", "function": {"name": ...}}', param)
    if value == "required" and not tools:
        raise invalid_argument(f"{param} 'required' needs tools", param)
    return value


def tool_request(tools: list[ToolSpec], choice: str, parallel: bool | None) -> ToolRequest | None:
    """None when the model is not to call tools (no tools, or tool_choice none)."""
    if not tools or choice == "none":
        return None
    return ToolRequest(tools, choice, True if parallel is None else parallel)


def check_arguments(arguments: str, where: str, param: str = "messages") -> None:
    """An earlier call's arguments must be a JSON object's text (templates receive it parsed)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        raise invalid_argument(f"{where}.arguments is not valid JSON: {arguments[:80]!r}", param) from None
    if not isinstance(value, dict):
        raise invalid_argument(f"{where}.arguments must be a JSON object", param)


def message_calls(calls: list[tuple[str, str, str, str]], where: str, param: str = "messages") -> list[ToolCall]:
    """An assistant turn's calls from (id, type, name, arguments) tuples, checked."""
    out = []
    for j, (call_id, kind, name, arguments) in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        if kind != "function":
            raise invalid_argument(f"{at}.type must be 'function' (got {kind!r})", param)
        if not call_id:
            raise invalid_argument(f"{at}.id must not be empty", param)
        if not name:
            raise invalid_argument(f"{at}.function.name must not be empty", param)
        check_arguments(arguments, f"{at}.function", param)
        out.append(ToolCall(call_id, name, arguments))
    return out
