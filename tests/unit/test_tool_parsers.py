"""Tool-call and reasoning parsers on recorded outputs: the whole text, and streamed in random chunkings
(the deltas must add up to exactly the whole parse)."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from radixmesh.gateway.reasoning import reasoning_parser
from radixmesh.gateway.tools.base import ToolCall, ToolSpec
from radixmesh.gateway.tools.output import ChoiceOutput
from radixmesh.gateway.tools.prompt import as_text
from radixmesh.gateway.tools.registry import TOOL_PARSERS, parser_for_model, tool_parser
from radixmesh.gateway.tools.stream import ToolCallStream
from tests.unit.tool_outputs import FAMILY_OUTPUTS, REASONING_OUTPUTS, SMOLLM2_OUTPUTS, Recorded, RecordedReasoning

NUM_CHUNKINGS = 40
ALL_OUTPUTS = FAMILY_OUTPUTS + SMOLLM2_OUTPUTS


def _chunks(text: str, rng: random.Random) -> list[str]:
    """`text` cut at random places: single characters, runs, or nothing at all."""
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.choice([0, 1, 3, 8, 30, len(text)]))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def _whole(parser_id: str, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    stream = ToolCallStream(tool_parser(parser_id))
    stream.update(text, final=True)
    return stream.content or None, [(c.name, c.arguments) for c in stream.calls]


@pytest.mark.parametrize("rec", ALL_OUTPUTS, ids=lambda r: r.id)
def test_recorded_output_parses_whole(rec: Recorded) -> None:
    assert _whole(rec.parser, rec.text) == (rec.content, rec.calls)


@pytest.mark.parametrize("rec", ALL_OUTPUTS, ids=lambda r: r.id)
def test_streamed_deltas_add_up_to_the_whole_parse(rec: Recorded) -> None:
    rng = random.Random(rec.id)
    for _ in range(NUM_CHUNKINGS):
        output = ChoiceOutput(tools=tool_parser(rec.parser))
        content, names, arguments, ids = "", {}, {}, {}
        pieces = _chunks(rec.text, rng)
        for i, piece in enumerate(pieces):
            delta = output.feed(piece, final=i == len(pieces) - 1)
            content += delta.content
            for call in delta.calls:
                if call.id is not None:
                    assert call.index not in ids and call.arguments == "", "a call starts once, with empty arguments"
                    ids[call.index], names[call.index] = call.id, call.name
                    arguments[call.index] = ""
                arguments[call.index] += call.arguments
        assert (content or None) == rec.content, pieces
        assert [(names[i], arguments[i]) for i in sorted(names)] == rec.calls, pieces
        assert [c.id for c in output.calls] == [ids[i] for i in sorted(ids)]


@pytest.mark.parametrize("rec", [r for r in ALL_OUTPUTS if r.calls and not r.id.endswith("max-tokens")],
                         ids=lambda r: r.id)
def test_complete_calls_have_json_object_arguments(rec: Recorded) -> None:
    for _, arguments in rec.calls:
        assert isinstance(json.loads(arguments), dict)


@pytest.mark.parametrize("rec", REASONING_OUTPUTS, ids=lambda r: r.id)
def test_reasoning_split_whole_and_streamed(rec: RecordedReasoning) -> None:
    parser = reasoning_parser(rec.parser)
    assert parser.split(rec.text, final=True) == (rec.reasoning, rec.content)
    rng = random.Random(rec.id)
    for _ in range(NUM_CHUNKINGS):
        output = ChoiceOutput(reasoning=parser)
        pieces = _chunks(rec.text, rng)
        deltas = [output.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert "".join(d.reasoning for d in deltas) == rec.reasoning, pieces
        assert "".join(d.content for d in deltas) == rec.content, pieces


def test_reasoning_then_tool_call_streamed() -> None:
    text = ('<think>\nThe user wants the weather; call the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Rome"}}\n</tool_call>')
    rng = random.Random(3)
    for _ in range(NUM_CHUNKINGS):
        output = ChoiceOutput(reasoning_parser("qwen3"), tool_parser("hermes"))
        pieces = _chunks(text, rng)
        deltas = [output.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert "".join(d.reasoning for d in deltas) == "The user wants the weather; call the tool."
        assert "".join(d.content for d in deltas) == ""
        assert [(c.name, c.arguments) for c in output.calls] == [("get_weather", '{"city": "Rome"}')]
        assert output.finish_reason("stop") == "tool_calls" and output.finish_reason("length") == "length"


def test_include_reasoning_false_drops_it() -> None:
    output = ChoiceOutput(reasoning_parser("deepseek-r1"), include_reasoning=False)
    delta = output.feed("secret plan</think>Answer.", final=True)
    assert (delta.reasoning, delta.content, output.reasoning, output.content) == ("", "Answer.", "", "Answer.")


def test_without_parsers_text_passes_untouched() -> None:
    output = ChoiceOutput()
    assert output.feed("  <tool_call>{", final=False).content == "  <tool_call>{"
    assert output.feed(" x ", final=True).content == " x "
    assert output.content == "  <tool_call>{ x " and output.finish_reason("stop") == "stop"


@pytest.mark.parametrize("parser_id", sorted(TOOL_PARSERS))
def test_each_parser_reads_back_what_it_writes(parser_id: str) -> None:
    parser = tool_parser(parser_id)
    calls = [ToolCall("call_1", "get_weather", '{"city": "Paris", "days": [1, 2]}'), ToolCall("call_2", "noop", "{}")]
    assert _whole(parser_id, parser.write_calls(calls)) == (None, [(c.name, c.arguments) for c in calls])
    assert _whole(parser_id, parser.write_calls(calls[:1])) == (None, [(calls[0].name, calls[0].arguments)])


def test_parser_follows_the_flag_then_the_template_then_the_name() -> None:
    assert parser_for_model("mistral", "hermes", ["Llama-3.1-8B"]) == "mistral"
    assert parser_for_model("llama3_json", "", []) == "llama3-json"
    assert parser_for_model(None, "llama3-json", ["Qwen2.5-7B"]) == "llama3-json"
    assert parser_for_model(None, "", ["/models/Meta-Llama-3.1-8B-Instruct"]) == "llama3-json"
    assert parser_for_model(None, "", ["Mistral-7B-Instruct-v0.3"]) == "mistral"
    assert parser_for_model(None, "", ["smollm2-135m-instruct"]) == "hermes"


def test_text_prompt_for_templates_without_tools() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [ToolSpec("get_weather", "Weather of a city", schema)]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
                {"role": "tool", "tool_call_id": "call_2", "content": "snow"}]
    out = as_text(messages, tools, tool_parser("hermes"))
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\n-3 C\n</tool_response>\n<tool_response>\nsnow\n</tool_response>"
    llama = as_text(messages[1:], tools, tool_parser("llama3-json"))
    assert llama[0]["role"] == "system" and '"parameters"' in llama[0]["content"]
    assert llama[2]["content"] == '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
