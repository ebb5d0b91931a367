"""Chat templates and tools: which templates take them, how they render calls and results, and the
tokenizer service passing them through (the default model's vocabulary with a tool-aware template)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from radixmesh.engine.chat_template import takes_tools, template_text, tool_syntax
from radixmesh.engine.hf_tokenizer import load_tokenizer, render_chat
from radixmesh.protocol import tokenizer_pb2
from radixmesh.tokenizer_service.service import TokenizerServicer
from radixmesh.wire.chat_convert import chat_to_proto, tools_from_proto
from tests.tool_template import tool_template_dir

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "name": "get_weather",
                                                         "arguments": '{"city": "Oslo"}'}]},
    {"role": "tool", "content": "-2 C", "tool_call_id": "call_1", "name": "get_weather"}]


@pytest.fixture(scope="module")
def default_tokenizer(default_model_dir: Path) -> Any:
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def tool_tokenizer(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_tokenizer(tool_template_dir(default_model_dir, tmp_path_factory.mktemp("tool-template")))


def test_which_templates_take_tools(default_tokenizer: Any, tool_tokenizer: Any) -> None:
    assert not takes_tools(template_text(default_tokenizer)) and tool_syntax(template_text(default_tokenizer)) == ""
    assert takes_tools(template_text(tool_tokenizer)) and tool_syntax(template_text(tool_tokenizer)) == "hermes"
    assert not takes_tools("{{ tools_note }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not takes_tools("{% if tools %}unclosed")
    mistral = "{% for t in tools %}{{ t | tojson }}{% endfor %}[TOOL_CALLS]"
    assert takes_tools(mistral) and tool_syntax(mistral) == "mistral"


def test_template_renders_tools_calls_and_results(tool_tokenizer: Any) -> None:
    text = render_chat(tool_tokenizer, MESSAGES, tools=TOOLS)
    assert json.dumps(TOOLS[0]) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text  # parsed
    assert "<tool_response>\n-2 C\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_tokenizer_service_passes_tools_to_the_template(tool_tokenizer: Any) -> None:
    servicer = TokenizerServicer(tool_tokenizer, "tool-template")
    conversation = chat_to_proto(MESSAGES, True, TOOLS)
    assert tools_from_proto(conversation) == TOOLS
    response = asyncio.run(servicer.Tokenize(tokenizer_pb2.TokenizeRequest(chat=conversation), None))
    assert response.prompt_text == render_chat(tool_tokenizer, MESSAGES, tools=TOOLS)
    info = asyncio.run(servicer.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest(), None))
    assert info.chat_template_takes_tools and info.chat_template_tool_syntax == "hermes"


def test_tool_turns_cross_the_wire_unchanged() -> None:
    conversation = chat_to_proto(MESSAGES, False)
    assert not conversation.tools and not conversation.add_generation_prompt
    call = conversation.messages[1].tool_calls[0]
    assert (call.id, call.name, call.arguments) == ("call_1", "get_weather", '{"city": "Oslo"}')
    assert (conversation.messages[2].tool_call_id, conversation.messages[2].name) == ("call_1", "get_weather")
