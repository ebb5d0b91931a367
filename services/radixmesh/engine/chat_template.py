"""What a model's chat template knows about tools: whether it renders them, and in which syntax.

A template that reads the `tools` variable renders the tool list, assistant tool calls and tool turns
itself (Qwen2.5, Llama 3.1, Mistral, Hermes); one that does not (SmolLM2's ChatML) leaves that to the
caller, which writes them into the messages as text. The syntax a template teaches the model is read
from the markers it writes, so a front end can pick the matching tool-call parser.
"""

from __future__ import annotations

import functools
from typing import Any

TOOL_SYNTAX_MARKERS = (("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"), ("<|python_tag|>", "llama3-json"),
                       ("ipython", "llama3-json"))
"""Text a template writes -> the tool-call syntax it teaches (first match wins)."""


def template_text(tokenizer: Any) -> str:
    """The tokenizer's default chat template ("" when it has none; the `default` one of a named set)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), "")
    return template if isinstance(template, str) else ""


@functools.lru_cache(maxsize=8)
def takes_tools(template: str) -> bool:
    """The template reads the `tools` variable (an unparsable template is taken not to)."""
    if "tools" not in template:
        return False
    import jinja2
    from jinja2 import meta

    try:
        names = meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False
    return "tools" in names


def tool_syntax(template: str) -> str:
    """The tool-call syntax the template teaches ("" when none is recognized)."""
    if not takes_tools(template):
        return ""
    return next((syntax for marker, syntax in TOOL_SYNTAX_MARKERS if marker in template), "")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-style messages in the shape Hugging Face templates read: a tool call's `arguments` parsed
    into an object (templates write it with `tojson`), empty fields left out."""
    import json

    out = []
    for message in messages:
        item = {key: value for key, value in message.items() if value not in (None, "", [])
                or key in ("role", "content")}
        calls = message.get("tool_calls") or []
        if calls:
            item["tool_calls"] = [{"id": call["id"], "type": "function", "function": {
                "name": call["name"], "arguments": json.loads(call["arguments"] or "{}")}} for call in calls]
        out.append(item)
    return out
