"""Calls that start with a marker anywhere in the text: Hermes/Qwen `<tool_call>` and Mistral `[TOOL_CALLS]`.

    hermes:   text <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call> text ...
    mistral:  text [TOOL_CALLS][{"name": "f", "arguments": {...}}, {"name": "g", "arguments": {...}}]
"""

from __future__ import annotations

from radixmesh.gateway.tools.base import (
    CallSyntax,
    ParsedCall,
    Scan,
    ToolCall,
    ToolCallParser,
    ToolSpec,
    call_object,
    held_back,
    tool_list_json,
)
from radixmesh.gateway.tools.json_scan import CallRun, CallScan, Memo, read_run, scan_call, skip_ws


def parsed(scan: CallScan, text: str) -> ParsedCall:
    assert scan.name is not None, "only named calls are parsed"
    return ParsedCall(scan.name, scan.arguments(text) or "", scan.complete and scan.valid)


class MarkedParser(ToolCallParser):
    """Text, and call regions that begin with `start`; `_region` reads one region."""

    start: str

    def scan(self, text: str, final: bool, memo: Memo | None = None) -> Scan:
        out = Scan()
        pos: int | None = 0
        while pos is not None:
            i = text.find(self.start, pos)
            if i < 0:
                tail = text[pos:]
                out.content += tail if final else tail[:len(tail) - held_back(tail, self.start)]
                return out
            out.content += text[pos:i]
            pos = self._region(text, i, final, out, memo)
        return out

    def _region(self, text: str, i: int, final: bool, out: Scan, memo: Memo | None) -> int | None:
        """Read the region at text[i]: add its calls (or its text, when it holds none) to `out`; the index
        where scanning goes on, or None when the region reaches the text's end."""
        raise NotImplementedError


class HermesParser(MarkedParser):
    """`<tool_call>` JSON `</tool_call>` blocks (Hermes, Qwen 2.5/3, and the default for other models)."""

    id = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def _region(self, text: str, i: int, final: bool, out: Scan, memo: Memo | None) -> int | None:
        k = skip_ws(text, i + len(self.start))
        scan = scan_call(text, k, memo) if k < len(text) else None
        if scan is not None and scan.name is not None:
            out.calls.append(parsed(scan, text))
            if scan.valid and not scan.complete:
                return None
        elif scan is None or (scan.valid and not scan.complete):
            if final:
                out.content += text[i:]
            return None
        close = text.find(self.end, scan.end or k)
        if close < 0:
            if final and scan.name is None:
                out.content += text[i:]
            return None
        if scan.name is None:
            out.content += text[i:close + len(self.end)]
        return close + len(self.end)

    @property
    def syntax(self) -> CallSyntax:
        return CallSyntax(begin='<tool_call>\n{"name": "NAME", "arguments": ', end="}\n</tool_call>", separator="\n",
                          trigger=self.start)

    def write_calls(self, calls: list[ToolCall]) -> str:
        return "\n".join(f"<tool_call>\n{call_object(call)}\n</tool_call>" for call in calls)

    def instructions(self, tools: list[ToolSpec]) -> str:
        return ("# Tools\n\nYou may call functions to help with the user's request. Their signatures, as JSON "
                f"Schema, are inside <tools></tools>:\n<tools>\n{tool_list_json(tools)}\n</tools>\n\n"
                "To call a function, write a JSON object with its name and arguments between <tool_call> and "
                "</tool_call>, one block per call:\n<tool_call>\n"
                '{"name": "<function name>", "arguments": {<arguments as a JSON object>}}\n</tool_call>')

    def write_result(self, call_id: str, name: str, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


class MistralParser(MarkedParser):
    """`[TOOL_CALLS]` followed by a JSON list of calls (Mistral 7B v0.3, Mixtral, Mistral Small/Nemo)."""

    id = "mistral"
    start = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def _region(self, text: str, i: int, final: bool, out: Scan, memo: Memo | None) -> int | None:
        k = skip_ws(text, i + len(self.start))
        if k >= len(text):
            if final:
                out.content += text[i:]
            return None
        if text[k] == "[":
            first = skip_ws(text, k + 1)
            if first >= len(text):
                if final:
                    out.content += text[i:]
                return None
            run = read_run(text, first, ",", "]", memo) if text[first] == "{" else CallRun([], failed_at=first)
        elif text[k] == "{":
            run = read_run(text, k, "", "", memo)
        else:
            out.content += self.start
            return i + len(self.start)
        return _settle(run, text, i, final, out)

    @property
    def syntax(self) -> CallSyntax:
        return CallSyntax(begin='{"name": "NAME", "arguments": ', end="}", separator=", ", prefix="[TOOL_CALLS][",
                          suffix="]", trigger=self.start)

    def write_calls(self, calls: list[ToolCall]) -> str:
        return "[TOOL_CALLS][" + ", ".join(call_object(call) for call in calls) + "]"

    def instructions(self, tools: list[ToolSpec]) -> str:
        return ("You may call functions to help with the user's request. Their signatures, as JSON Schema, one "
                f"per line:\n{tool_list_json(tools)}\n\nTo call functions, answer with [TOOL_CALLS] followed by a "
                'JSON list of calls: [TOOL_CALLS][{"name": "<function name>", "arguments": {<arguments>}}]')


def _settle(run: CallRun, text: str, region_start: int, final: bool, out: Scan) -> int | None:
    """Add a run's calls to `out`; where scanning goes on (None: the run reaches the text's end). A run that
    failed before its first call is the region's text; one that failed later drops the rest of the output."""
    out.calls += [parsed(scan, text) for scan, _ in run.calls]
    if run.failed_at is not None and not run.calls:
        out.content += text[region_start:]
        return None
    if run.pending:
        if final and not run.calls:
            out.content += text[region_start:]
        return None
    return run.end
