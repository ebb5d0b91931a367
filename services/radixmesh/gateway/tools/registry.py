"""Tool-call parser id -> lazily imported class; --tool-call-parser takes these ids.

Without the flag the parser follows the model: the syntax its chat template teaches (read by the
tokenizer, `radixmesh.engine.chat_template`), else its name, else `hermes` (the syntax radixmesh writes
into the prompt of a template that renders no tools).
"""

from __future__ import annotations

import re

from radixmesh.common.registry import LazyRegistry
from radixmesh.gateway.tools.base import ToolCallParser

TOOL_PARSERS: LazyRegistry[type[ToolCallParser]] = LazyRegistry("tool-call parser", {
    "hermes": "radixmesh.gateway.tools.tagged:HermesParser",
    "mistral": "radixmesh.gateway.tools.tagged:MistralParser",
    "llama3-json": "radixmesh.gateway.tools.leading:Llama3JsonParser",
    "json": "radixmesh.gateway.tools.leading:JsonParser",
}, param="tool_call_parser")
DEFAULT_TOOL_PARSER = "hermes"
MODEL_NAME_PARSERS = ((re.compile(r"llama-?3", re.I), "llama3-json"), (re.compile(r"mi[sx]tral", re.I), "mistral"),
                      (re.compile(r"qwen|hermes", re.I), "hermes"))
"""Model names -> the syntax of their family (when the template names none)."""


def check_tool_parser(name: str) -> str:
    """The registry id for `name` (underscores read as dashes), or INVALID_ARGUMENT listing the known ones."""
    key = name.replace("_", "-").lower()
    TOOL_PARSERS.check(key)
    return key


def tool_parser(name: str) -> ToolCallParser:
    return TOOL_PARSERS.load(check_tool_parser(name))()


def parser_for_model(configured: str | None, template_syntax: str, model_names: list[str]) -> str:
    """The parser id: the configured one, else the template's syntax, else by model name, else the default."""
    if configured:
        return check_tool_parser(configured)
    if template_syntax in TOOL_PARSERS:
        return template_syntax
    for pattern, parser in MODEL_NAME_PARSERS:
        if any(pattern.search(name) for name in model_names):
            return parser
    return DEFAULT_TOOL_PARSER
