"""Chat conversations with tools <-> the tokenizer service's ChatConversation (tokenizer.proto).

Messages are the Backend contract's dicts: {role, content} plus `tool_calls` [{id, name, arguments}] on
assistant turns and `tool_call_id` / `name` on tool turns; tools are OpenAI's `{"type": "function",
"function": {name, description, parameters}}` entries.
"""

from __future__ import annotations

import json
from typing import Any

from radixmesh.common.errors import invalid_argument
from radixmesh.protocol import tokenizer_pb2


def chat_to_proto(messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                  tools: list[dict[str, Any]] | None = None) -> tokenizer_pb2.ChatConversation:
    try:
        chat = [tokenizer_pb2.ChatMessage(
            role=str(m["role"]), content=str(m["content"] or ""), tool_call_id=m.get("tool_call_id") or "",
            name=m.get("name") or "",
            tool_calls=[tokenizer_pb2.ChatToolCall(id=c["id"], name=c["name"], arguments=c["arguments"])
                        for c in m.get("tool_calls") or []]) for m in messages]
    except KeyError as exc:
        raise invalid_argument(f"every message needs a {exc.args[0]!r}", "messages") from None
    functions = [tool["function"] for tool in tools or []]
    return tokenizer_pb2.ChatConversation(
        messages=chat, add_generation_prompt=add_generation_prompt,
        tools=[tokenizer_pb2.ChatTool(name=f["name"], description=f.get("description") or "",
                                      parameters_json=json.dumps(f["parameters"]) if f.get("parameters") else "")
               for f in functions])


def tool_turn_fields(message: tokenizer_pb2.ChatMessage) -> dict[str, Any]:
    """The tool fields of one message, only those set."""
    fields: dict[str, Any] = {}
    if message.tool_calls:
        fields["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in message.tool_calls]
    if message.tool_call_id:
        fields["tool_call_id"] = message.tool_call_id
    if message.name:
        fields["name"] = message.name
    return fields


def tools_from_proto(chat: tokenizer_pb2.ChatConversation) -> list[dict[str, Any]] | None:
    """The conversation's tools in OpenAI's shape (None when it has none)."""
    if not chat.tools:
        return None
    out = []
    for i, tool in enumerate(chat.tools):
        try:
            parameters = json.loads(tool.parameters_json) if tool.parameters_json else {"type": "object",
                                                                                          "properties": {}}
        except ValueError:
            raise invalid_argument(f"tools[{i}].parameters_json is not valid JSON", "tools") from None
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        function["parameters"] = parameters
        out.append({"type": "function", "function": function})
    return out
