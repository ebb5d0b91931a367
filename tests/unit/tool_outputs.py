"""Model outputs with tool calls and reasoning, and what each must parse to.

Two kinds: `FAMILY_OUTPUTS` are written in each family's published syntax (the chat templates of Qwen2.5,
Hermes 2 Pro, Mistral 7B v0.3 and Llama 3.1/3.2 teach it; no such model runs on this project's CPU test
machines); `SMOLLM2_OUTPUTS` were recorded from the default model (SmolLM2-135M-Instruct, unconstrained,
temperature 1) with the prompt radixmesh writes for each parser, by `scripts/record_tool_outputs.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Recorded:
    """An output and its parse: the content (None when empty) and the (name, arguments) of each call."""

    id: str
    parser: str
    text: str
    content: str | None
    calls: list[tuple[str, str]] = field(default_factory=list)


FAMILY_OUTPUTS = [
    # Hermes 2 Pro / Qwen 2.5 / Qwen 3: <tool_call> blocks, possibly after text
    Recorded("qwen-two-calls", "hermes",
             '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, '
             'CA, USA", "date": "2024-10-01"}}\n</tool_call>', None,
             [("get_current_temperature", '{"location": "San Francisco, CA, USA"}'),
              ("get_temperature_date", '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}')]),
    Recorded("qwen-text-then-call", "hermes",
             'I\'ll look that up.\n\n<tool_call>\n{"name": "search", "arguments": {"query": "radix attention", "k": '
             '3}}\n</tool_call>', "I'll look that up.", [("search", '{"query": "radix attention", "k": 3}')]),
    Recorded("hermes-no-call", "hermes", "Use x < y, and <b>bold</b> <tool for emphasis.",
             "Use x < y, and <b>bold</b> <tool for emphasis."),
    Recorded("hermes-end-marker-inside-string", "hermes",
             '<tool_call>\n{"name": "echo", "arguments": {"text": "say </tool_call> and {braces}"}}\n</tool_call>',
             None, [("echo", '{"text": "say </tool_call> and {braces}"}')]),
    Recorded("hermes-escapes-and-unicode", "hermes",
             '<tool_call>\n{"name": "translate", "arguments": {"text": "caf\\u00e9 \\"quoted\\" \\\\", "to": "日本語"}}'
             '\n</tool_call>', None, [("translate", '{"text": "caf\\u00e9 \\"quoted\\" \\\\", "to": "日本語"}')]),
    Recorded("hermes-arguments-before-name", "hermes",
             '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>', None,
             [("get_weather", '{"city": "Oslo"}')]),
    Recorded("hermes-arguments-as-string", "hermes",
             '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>', None,
             [("get_weather", '{"city": "Oslo"}')]),
    Recorded("hermes-cut-by-max-tokens", "hermes",
             'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "Checking.",
             [("get_weather", '{"city": "Par')]),
    Recorded("hermes-not-json-inside", "hermes", "<tool_call>\nget_weather(city=Paris)\n</tool_call> sorry",
             "<tool_call>\nget_weather(city=Paris)\n</tool_call> sorry"),
    Recorded("hermes-text-between-calls", "hermes",
             'First:\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\nand then\n<tool_call>\n'
             '{"name": "b", "arguments": {"n": [1, 2, {"x": null}]}}\n</tool_call>', "First:\n\nand then",
             [("a", "{}"), ("b", '{"n": [1, 2, {"x": null}]}')]),
    # Mistral 7B Instruct v0.3 / Mixtral: [TOOL_CALLS] and a JSON list
    Recorded("mistral-one-call", "mistral",
             '[TOOL_CALLS][{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": '
             '"celsius"}}]', None,
             [("get_current_weather", '{"location": "Paris, France", "format": "celsius"}')]),
    Recorded("mistral-two-calls-spaced", "mistral",
             '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": "]"}}]', None,
             [("a", '{"x": 1}'), ("b", '{"y": "]"}')]),
    Recorded("mistral-no-call", "mistral", "The weather is fine [today].", "The weather is fine [today]."),
    Recorded("mistral-marker-without-list", "mistral", "[TOOL_CALLS] none needed", "[TOOL_CALLS] none needed"),
    # Llama 3.1 / 3.2 / 3.3: a JSON object with "parameters", after <|python_tag|> when special tokens are kept
    Recorded("llama-one-call", "llama3-json", '{"name": "get_weather", "parameters": {"city": "San Francisco"}}', None,
             [("get_weather", '{"city": "San Francisco"}')]),
    Recorded("llama-python-tag", "llama3-json",
             '<|python_tag|>{"name": "brave_search", "parameters": {"query": "weather in SF"}}', None,
             [("brave_search", '{"query": "weather in SF"}')]),
    Recorded("llama-two-calls", "llama3-json",
             '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": 2}}', None,
             [("a", '{"x": 1}'), ("b", '{"y": 2}')]),
    Recorded("llama-answer", "llama3-json", "The capital of France is Paris.", "The capital of France is Paris."),
    Recorded("llama-json-answer-not-a-call", "llama3-json", '{"answer": 42}', '{"answer": 42}'),
    Recorded("llama-call-mid-text-is-text", "llama3-json", 'Try {"name": "a", "parameters": {}}',
             'Try {"name": "a", "parameters": {}}'),
    # the generic JSON syntax: an object or a list of objects
    Recorded("json-object", "json", '{"name": "lookup", "arguments": {"id": 7, "fields": ["a", "b"]}}', None,
             [("lookup", '{"id": 7, "fields": ["a", "b"]}')]),
    Recorded("json-list", "json", '[{"name": "a", "arguments": {}}, {"name": "b", "parameters": {"q": "x"}}]', None,
             [("a", "{}"), ("b", '{"q": "x"}')]),
    Recorded("json-plain-list", "json", "[1, 2, 3]", "[1, 2, 3]"),
    Recorded("json-prose", "json", "No function is needed.", "No function is needed."),
]


@dataclass(frozen=True)
class RecordedReasoning:
    id: str
    parser: str
    text: str
    reasoning: str
    content: str


REASONING_OUTPUTS = [
    RecordedReasoning("r1-opened-in-prompt", "deepseek-r1",
                      "The user asks 2+2.\nThat is 4.\n</think>\n\nIt is **4**.", "The user asks 2+2.\nThat is 4.",
                      "It is **4**."),
    RecordedReasoning("r1-written-open", "deepseek-r1", "<think>\nshort\n</think>\nDone.", "short", "Done."),
    RecordedReasoning("r1-cut-while-thinking", "deepseek-r1", "Still thinking about </thi",
                      "Still thinking about </thi", ""),
    RecordedReasoning("qwen3-thinking", "qwen3", "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
                      "The user greets me.", "Hello! How can I help?"),
    RecordedReasoning("qwen3-thinking-off", "qwen3", "Hello! The tag </think> stays.", "",
                      "Hello! The tag </think> stays."),
    RecordedReasoning("qwen3-empty-thinking", "qwen3", "<think>\n\n</think>\n\nHi.", "", "Hi."),
]



def _prose(id_: str, parser: str, text: str) -> Recorded:
    """A recorded answer with no call in it: all of it is content."""
    return Recorded(id_, parser, text, text.strip())


# Recorded by `scripts/record_tool_outputs.py` (temperature 1, max_tokens 100-120): the unconstrained default model
# rarely writes the call syntax at all, which is what these keep: prose, JSON that is not a call, and one object
# with a "name" that Llama's syntax reads as a call (cut by max_tokens).
SMOLLM2_OUTPUTS = [
    _prose('smollm2-json-prose', 'json',
           "_I'm not the only lazy one_\n\nSince I asked, the weather in Kyoto is pretty cool. Thanks f"
           'or asking.'),
    _prose('smollm2-json-broken-object', 'json',
           '{\n  "type": "function"\n...'),
    _prose('smollm2-llama-parenthesized-json', 'llama3-json',
           '({\n  "type": "function",\n  "function": {\n    "name": "health-system-product-navaalu"\n  '
           '}\n});\n\nAna will order a mug for each of these orders, and in plain text with JSONS defin'
           'ition of a mug order and time. Next, Aniar will express a quantity of a mug to the woman Di'
           'emalaarle Tzuluá.'),
    _prose('smollm2-mistral-json-without-marker', 'mistral',
           'GM_FUTILT Edition:\n{"type": "unnamed", "function": {\n    "name": "view_city_area"\n, "fie'
           'ld": "fare"}\n}\nGoogle Maps:\n{"type": "function", "function": {\n    "name": "view_city_a'
           'rea`"\n},\n{"type": "function", "function": {"name": "view_sqiaquilm_if_gualzet"}}'),
    _prose('smollm2-mistral-prose', 'mistral',
           'To call functions, we need to populate a message in the form of a JSON array. We can use th'
           'e STRING method to create a JSON string and call a function:\narray(JSON.stringify(get_mugs'
           '[0], 2))\n```'),
    _prose('smollm2-hermes-prose', 'hermes',
           "Lara, welcome to Lara's Food Truck. I'll be happy to order ye. What can I do for ye from af"
           "ar? You're now available at the food cart in Lima."),
    Recorded('smollm2-llama-named-object-cut', 'llama3-json',
             '{\n  "name": "Ana, Teleno Zambiamara",\n  "description": "Armasa feria, paradoras áudem com'
             ' Aoca",\n  "type": "function",\n  "parameters": {\n    "type": "function",\n    "name": "ce'
             'rtified"\n  },\n  "image_transcription": function _(image) {\n    "current_image"\n    : [{'
             '\n      "image_transcription": {\n        "module',
             None, [('Ana, Teleno Zambiamara', '{\n    "type": "function",\n    "name": "certified"\n  }')]),
]
