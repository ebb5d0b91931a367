"""`radixmesh bench tool-calls`: how many sampled tool calls parse and validate, constrained or not.

Sends chat requests with tools whose schemas nest objects and arrays to a running server (`serve` or a
gateway), `n` samples per request at the given temperature, and checks every answer's calls: the name is
one of the tools and the arguments are JSON that validates against that tool's schema. `--tool-choice
required` (constrained decoding) should give 100%; `auto` (free text, parsed afterwards) shows what a
parser alone gets from the model.

    radixmesh bench tool-calls --url http://127.0.0.1:8000 --num-calls 100 --tool-choice required auto
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

_STR = {"type": "string", "minLength": 1, "maxLength": 24}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "create_order", "description": "Order items for a customer and ship them",
        "parameters": {"type": "object", "properties": {
            "customer": {"type": "object", "properties": {
                "name": _STR,
                "address": {"type": "object", "properties": {
                    "city": {"enum": ["Paris", "Berlin", "Tokyo", "Lima"]},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
                "required": ["name", "address"]},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                "quantity": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["sku", "quantity"]}},
            "express": {"type": "boolean"}}, "required": ["customer", "items", "express"]}}},
    {"type": "function", "function": {
        "name": "schedule_meeting", "description": "Put a meeting in the calendar",
        "parameters": {"type": "object", "properties": {
            "title": _STR,
            "when": {"type": "object", "properties": {
                "date": {"type": "string", "pattern": "^2026-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"},
                "hour": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["date", "hour"]},
            "attendees": {"type": "array", "minItems": 1, "maxItems": 4, "items": _STR}},
            "required": ["title", "when", "attendees"]}}},
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather at a place",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "object", "properties": {"city": _STR, "country": {"enum": ["FR", "DE", "JP", "PE"]}},
                         "required": ["city", "country"]},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["location", "unit"]}}},
]
PROMPTS = [
    "Order two coffee mugs for Ana Silva, shipped fast to her home in Lima.",
    "Book a meeting called budget review with Tom and Mia on March 3rd at 10.",
    "What is the weather like in Kyoto right now?",
    "I need three notebooks sent to Paul in Berlin, no rush.",
]


@dataclass
class ToolCallResult:
    """Answers and calls of one mode, and how many validate."""

    tool_choice: str
    answers: int = 0
    answers_with_calls: int = 0
    calls: int = 0
    valid_calls: int = 0
    valid_answers: int = 0
    """Answers with at least one call, every call valid."""
    finish_reasons: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    """Why calls failed (the first few)."""

    @property
    def rate(self) -> float:
        return self.valid_answers / self.answers if self.answers else 0.0


def call_problem(call: dict[str, Any], schemas: dict[str, dict[str, Any]]) -> str:
    """"" when the call names a tool and its arguments validate; else what is wrong."""
    import jsonschema

    name = call["function"]["name"]
    if name not in schemas:
        return f"unknown function {name!r}"
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError as exc:
        return f"{name}: arguments are not JSON ({exc})"
    try:
        jsonschema.validate(arguments, schemas[name])
    except jsonschema.ValidationError as exc:
        return f"{name}: {exc.message}"
    return ""


def score(result: ToolCallResult, choices: list[dict[str, Any]], schemas: dict[str, dict[str, Any]]) -> None:
    for choice in choices:
        result.answers += 1
        reason = str(choice["finish_reason"])
        result.finish_reasons[reason] = result.finish_reasons.get(reason, 0) + 1
        calls = choice["message"].get("tool_calls") or []
        problems = [call_problem(call, schemas) for call in calls]
        result.calls += len(calls)
        result.valid_calls += problems.count("")
        result.answers_with_calls += bool(calls)
        result.valid_answers += bool(calls) and not any(problems)
        result.failures += [p for p in problems if p][:max(0, 5 - len(result.failures))]


def run(url: str, tool_choice: str, num_calls: int, temperature: float = 1.0, seed: int = 20261127,
        max_tokens: int = 320, api_key: str | None = None) -> ToolCallResult:
    """`num_calls` answers (one call each asked, parallel_tool_calls false), spread over the prompts, all
    requests in flight at once so the engine batches them."""
    import httpx

    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    per_prompt = [num_calls // len(PROMPTS) + (i < num_calls % len(PROMPTS)) for i in range(len(PROMPTS))]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def ask(i: int) -> list[dict[str, Any]]:
        body = {"model": "default", "messages": [{"role": "user", "content": PROMPTS[i]}], "tools": TOOLS,
                "tool_choice": tool_choice, "parallel_tool_calls": False, "n": per_prompt[i],
                "temperature": temperature, "max_tokens": max_tokens, "seed": seed + 1000 * i}
        response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=3600)
        response.raise_for_status()
        choices: list[dict[str, Any]] = response.json()["choices"]
        return choices

    result = ToolCallResult(tool_choice)
    asked = [i for i in range(len(PROMPTS)) if per_prompt[i]]
    with ThreadPoolExecutor(len(asked)) as pool:
        for choices in pool.map(ask, asked):
            score(result, choices, schemas)
    return result


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("tool-calls", help="sampled tool calls that parse and validate (constrained or not)")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--num-calls", type=int, default=100, help="answers per tool_choice")
    parser.add_argument("--tool-choice", nargs="+", default=["required", "auto"], help="modes to run")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=320)
    parser.add_argument("--api-key", default=None)
    parser.set_defaults(func=cmd_tool_calls)


def cmd_tool_calls(args: argparse.Namespace) -> int:
    for choice in args.tool_choice:
        result = run(args.url, choice, args.num_calls, args.temperature, max_tokens=args.max_tokens,
                     api_key=args.api_key)
        print(json.dumps({**asdict(result), "rate": round(result.rate, 4)}))
    return 0
