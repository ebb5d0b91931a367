"""Calls written as plain JSON at the start of the answer: Llama 3.x and the generic JSON syntax.

    llama3-json:  [<|python_tag|>]{"name": "f", "parameters": {...}}; {"name": "g", "parameters": {...}}
    json:         {"name": "f", "arguments": {...}}   or   [{"name": "f", "arguments": {...}}, ...]

An answer that does not start with a call object is all content.
"""

from __future__ import annotations

import json

from radixmesh.gateway.tools.base import (
    CallSyntax,
    Scan,
    ToolCall,
    ToolCallParser,
    ToolSpec,
    call_object,
    tool_list_json,
)
from radixmesh.gateway.tools.json_scan import CallRun, Memo, read_run, skip_ws
from radixmesh.gateway.tools.tagged import parsed

PYTHON_TAG = "<|python_tag|>"


class LeadingJsonParser(ToolCallParser):
    """Calls only at the start; `_run` reads them from the first non-space character."""

    opening = ""
    """Text that may come before the first call (Llama's <|python_tag|>)."""

    def scan(self, text: str, final: bool, memo: Memo | None = None) -> Scan:
        k = skip_ws(text, 0)
        if self.opening and text.startswith(self.opening, k):
            k = skip_ws(text, k + len(self.opening))
        rest = text[k:]
        if not rest or (self.opening and self.opening.startswith(rest) and k == skip_ws(text, 0)):
            return Scan(content=text if final else "")
        run = self._run(text, k, memo)
        if run is None or (run.failed_at is not None and not run.calls):
            return Scan(content=text)
        out = Scan(calls=[parsed(scan, text) for scan, _ in run.calls])
        if run.pending:
            if final and not run.calls:
                out.content = text
            return out
        tail_from = run.end if run.end is not None else run.failed_at
        assert tail_from is not None, "a finished run has an end"
        out.content = text[tail_from:]
        return out

    def _run(self, text: str, k: int, memo: Memo | None) -> CallRun | None:
        """The calls from text[k] (a non-space character), or None when the answer is not calls."""
        raise NotImplementedError


class Llama3JsonParser(LeadingJsonParser):
    """Llama 3.1/3.2/3.3 JSON tool calls (`parameters`), optionally after <|python_tag|>, joined by ';'."""

    id = "llama3-json"
    opening = PYTHON_TAG

    def _run(self, text: str, k: int, memo: Memo | None) -> CallRun | None:
        return read_run(text, k, ";", "", memo) if text[k] == "{" else None

    @property
    def syntax(self) -> CallSyntax:
        return CallSyntax(begin='{"name": "NAME", "parameters": ', end="}", separator="; ")

    def write_calls(self, calls: list[ToolCall]) -> str:
        return "; ".join(call_object(call, "parameters") for call in calls)

    def instructions(self, tools: list[ToolSpec]) -> str:
        return ("You may call functions to help with the user's request. Their signatures, as JSON Schema, one per "
                f"line:\n{tool_list_json(tools)}\n\nTo call a function, answer with only a JSON object of the form "
                '{"name": "<function name>", "parameters": {<arguments>}}; separate several calls with "; ".')

    def write_result(self, call_id: str, name: str, content: str) -> str:
        return content


class JsonParser(LeadingJsonParser):
    """An answer that is one call object, or a JSON list of them (`arguments` or `parameters`)."""

    id = "json"

    def _run(self, text: str, k: int, memo: Memo | None) -> CallRun | None:
        if text[k] == "{":
            return read_run(text, k, "", "", memo)
        if text[k] != "[":
            return None
        first = skip_ws(text, k + 1)
        if first >= len(text):
            return CallRun([])
        return read_run(text, first, ",", "]", memo) if text[first] == "{" else None

    @property
    def syntax(self) -> CallSyntax:
        return CallSyntax(begin='{"name": "NAME", "arguments": ', end="}", separator=", ", prefix="[", suffix="]")

    def write_calls(self, calls: list[ToolCall]) -> str:
        if len(calls) == 1:
            return call_object(calls[0])
        return "[" + ", ".join(call_object(call) for call in calls) + "]"

    def instructions(self, tools: list[ToolSpec]) -> str:
        example = json.dumps({"name": "<function name>", "arguments": {}})
        return ("You may call functions to help with the user's request. Their signatures, as JSON Schema, one per "
                f"line:\n{tool_list_json(tools)}\n\nTo call a function, answer with only a JSON object {example} "
                "holding its name and arguments, or a JSON list of such objects for several calls.")
