"""Tools and tool turns into the prompt, through the model's chat template or, when it has no tool syntax,
as text in the parser's syntax.

A template that reads `tools` (Qwen, Llama 3.1, Mistral, Hermes) gets the tools and the messages as they
are: assistant `tool_calls` and `tool` turns. A template that does not (the default SmolLM2 ChatML one)
would drop them silently, so they are written as text instead, as vLLM and SGLang users know it from
Hermes-style templates: a block in the system message lists the tools and shows the call syntax, earlier
calls become the assistant turn's text, and tool results become user turns.
"""

from __future__ import annotations

from typing import Any

from radixmesh.gateway.tools.base import ToolCall, ToolCallParser, ToolSpec

ChatMessages = list[dict[str, Any]]
"""{"role", "content": str} plus, for assistant turns, "tool_calls": [{"id", "name", "arguments"}] and, for tool
turns, "tool_call_id" and "name"."""


def template_inputs(messages: ChatMessages, tools: list[ToolSpec], parser: ToolCallParser,
                    takes_tools: bool) -> tuple[ChatMessages, list[dict[str, Any]] | None]:
    """The messages and the `tools` variable for the chat template (None: no tools for it)."""
    if takes_tools:
        return messages, [tool.openai() for tool in tools] or None
    return as_text(messages, tools, parser), None


def as_text(messages: ChatMessages, tools: list[ToolSpec], parser: ToolCallParser) -> ChatMessages:
    """Plain {role, content} turns: calls and results written in the parser's syntax, the tools in a system
    block (appended to the conversation's own system message, or a new one first)."""
    out: ChatMessages = []
    names: dict[str, str] = {}
    previous_was_result = False
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        calls = [ToolCall(c["id"], c["name"], c["arguments"]) for c in message.get("tool_calls") or []]
        names.update((call.id, call.name) for call in calls)
        if role == "tool":
            call_id = message.get("tool_call_id") or ""
            text = parser.write_result(call_id, message.get("name") or names.get(call_id, ""), content)
            if previous_was_result:
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text})
            previous_was_result = True
            continue
        previous_was_result = False
        if calls:
            written = parser.write_calls(calls)
            content = f"{content}\n{written}" if content else written
        out.append({"role": role, "content": content})
    if tools:
        block = parser.instructions(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def has_tool_turns(messages: ChatMessages) -> bool:
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
