"""One choice's answer as the text grows: reasoning, content and tool calls, whole or as deltas.

The reasoning parser (if any) splits the thinking off first; the tool-call parser (if the request has
tools) reads calls out of the rest. Without either the text passes through untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixmesh.gateway.reasoning import ReasoningParser
from radixmesh.gateway.tools.base import ToolCall, ToolCallParser
from radixmesh.gateway.tools.stream import CallDelta, ToolCallStream


@dataclass
class OutputDelta:
    """What one step added to the answer."""

    content: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)


class ChoiceOutput:
    """Feed the choice's text deltas (`feed`), then read the whole answer (`content`, `reasoning`, `calls`)."""

    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolCallParser | None = None,
                 include_reasoning: bool = True, max_calls: int | None = None) -> None:
        self.reasoning_parser = reasoning
        self.include_reasoning = include_reasoning
        self.tools = ToolCallStream(tools, max_calls) if tools is not None else None
        self.text = ""
        self.content = ""
        self.reasoning = ""
        self.finished = False

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    def feed(self, text: str, final: bool = False) -> OutputDelta:
        """Add the next text of the output; `final` once it is complete."""
        assert not self.finished, "the output was already final"
        self.text += text
        self.finished = final
        if self.reasoning_parser is None and self.tools is None:
            self.content += text
            return OutputDelta(content=text)
        delta = OutputDelta()
        answer = self.text
        if self.reasoning_parser is not None:
            reasoning, answer = self.reasoning_parser.split(self.text, final)
            if self.include_reasoning:
                delta.reasoning = reasoning[len(self.reasoning):]
                self.reasoning = reasoning
        if self.tools is not None:
            delta.content, delta.calls = self.tools.update(answer, final)
            self.content += delta.content
        else:
            delta.content = answer[len(self.content):]
            self.content = answer
        return delta

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's `tool_calls` for an answer that stopped with calls; the engine's reason otherwise."""
        return "tool_calls" if engine_reason == "stop" and self.calls else engine_reason
