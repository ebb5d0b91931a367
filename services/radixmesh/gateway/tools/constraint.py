"""Tool choice -> the xgrammar structural tag that makes every call parse and validate.

    required        one or more calls (one with parallel_tool_calls false), nothing else
    named function  exactly one call of that function
    auto (--strict-tools)  free text; a call, once started, is one of the tools with valid arguments

Each call is the parser's `begin(name)` + an arguments object that follows the tool's JSON Schema +
`end`, so the name is always one of the tools and the arguments always validate. The tag is compiled
and cached like any grammar (the engine's compile pool, or the grammar service in a cluster).
"""

from __future__ import annotations

import json
from typing import Any

from radixmesh.gateway.tools.base import CallSyntax, ToolSpec

MAX_ARGUMENT_WHITESPACE = 1
"""Most whitespace characters in a row inside the arguments (xgrammar's JSON allows any: a sampling model
could otherwise wander in blank space until max_tokens)."""


def _call_tag(syntax: CallSyntax, tool: ToolSpec, wrap: bool = False) -> dict[str, Any]:
    begin, end = syntax.call_begin(tool.name), syntax.end
    if wrap:
        begin, end = syntax.prefix + begin, end + syntax.suffix
    return {"type": "tag", "begin": begin, "end": end,
            "content": {"type": "json_schema", "json_schema": tool.parameters,
                        "max_whitespace_cnt": MAX_ARGUMENT_WHITESPACE}}


def _calls(syntax: CallSyntax, tools: list[ToolSpec], one: bool) -> dict[str, Any]:
    """One or more calls (exactly one with `one`), wrapped in the syntax's prefix and suffix."""
    calls: dict[str, Any] = {"type": "tags_with_separator", "separator": syntax.separator, "at_least_one": True,
                             "stop_after_first": one, "tags": [_call_tag(syntax, tool) for tool in tools]}
    if not syntax.prefix and not syntax.suffix:
        return calls
    return {"type": "tag", "begin": syntax.prefix, "content": calls, "end": syntax.suffix}


def _free_text_or_calls(syntax: CallSyntax, tools: list[ToolSpec], one: bool) -> dict[str, Any]:
    """auto: text with calls after `syntax.trigger`; for syntaxes whose calls only come first, either calls
    or text that does not start like one."""
    if syntax.trigger:
        return {"type": "triggered_tags", "triggers": [syntax.trigger], "stop_after_first": one,
                "tags": [_call_tag(syntax, tool, wrap=True) for tool in tools]}
    text = {"type": "sequence", "elements": [{"type": "regex", "pattern": r"[^\s{\[]"}, {"type": "any_text"}]}
    return {"type": "or", "elements": [_calls(syntax, tools, one), text]}


def tool_call_tag(syntax: CallSyntax, tools: list[ToolSpec], choice: str, parallel: bool,
                  reasoning_end: str | None = None) -> str:
    """The structural tag (compact JSON) for `choice`: "required", "auto", or the name of one tool.

    `reasoning_end`: with a reasoning parser the answer may first think, up to this marker.
    """
    if choice == "required":
        body = _calls(syntax, tools, one=not parallel)
    elif choice == "auto":
        body = _free_text_or_calls(syntax, tools, one=not parallel)
    else:
        named = [tool for tool in tools if tool.name == choice]
        assert named, f"tool_choice {choice!r} is not one of the tools"
        body = _calls(syntax, named, one=True)
    if reasoning_end:
        thinking = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": reasoning_end}
        body = {"type": "or", "elements": [{"type": "sequence", "elements": [thinking, body]}, body]}
    return json.dumps({"type": "structural_tag", "format": body}, separators=(",", ":"), ensure_ascii=False)
