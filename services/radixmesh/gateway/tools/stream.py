"""Tool calls and content of one choice as the output grows: deltas shaped as OpenAI streams them.

OpenAI sends a call's index, id, type and name first (arguments ""), then pieces of its arguments;
content arrives as its own deltas. `ToolCallStream.update` takes the whole output so far and returns
what is new since the last call; after `final` its `calls` and `content` are the complete answer, equal
to the concatenation of everything it streamed.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from radixmesh.gateway.tools.base import ToolCall, ToolCallParser
from radixmesh.gateway.tools.json_scan import Memo


@dataclass(frozen=True)
class CallDelta:
    """One piece of one call: the first carries `id` and `name` (and `arguments` ""), later ones more arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """Content (trimmed of surrounding whitespace) and calls of one choice's output; with `max_calls`, calls
    beyond that many are dropped (parallel_tool_calls false when decoding did not enforce it)."""

    def __init__(self, parser: ToolCallParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.content = ""
        self.ids: list[str] = []
        self.names: list[str] = []
        self.arguments: list[str] = []
        self.memo: Memo = {}

    def update(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        """(new content, new call pieces) for the output `text` so far."""
        scan = self.parser.scan(text, final, self.memo)
        content = scan.content.strip()
        assert content.startswith(self.content), f"{self.parser.id}: content went back from {self.content!r}"
        new_content, self.content = content[len(self.content):], content
        deltas = []
        for index, call in enumerate(scan.calls[:self.max_calls]):
            if index == len(self.ids):
                self.ids.append(new_call_id())
                self.names.append(call.name)
                self.arguments.append("")
                deltas.append(CallDelta(index, "", self.ids[index], call.name))
            sent = self.arguments[index]
            assert call.arguments.startswith(sent), f"{self.parser.id}: arguments went back from {sent!r}"
            if len(call.arguments) > len(sent):
                deltas.append(CallDelta(index, call.arguments[len(sent):]))
                self.arguments[index] = call.arguments
        return new_content, deltas

    @property
    def calls(self) -> list[ToolCall]:
        return [ToolCall(id_, name, args) for id_, name, args in zip(self.ids, self.names, self.arguments)]
