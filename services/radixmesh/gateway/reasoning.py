"""Reasoning parsers: a thinking model's `<think>...</think>` apart from its answer (--reasoning-parser).

    deepseek-r1  the answer starts inside the thinking (its template opens `<think>` in the prompt; a
                 written `<think>` is dropped too): everything up to `</think>` is reasoning, and all of
                 the output when it never closes (cut by max_tokens)
    qwen3        reasoning only when the answer opens with `<think>` (Qwen3 with thinking on); otherwise
                 the whole answer is content (thinking off, or a model that does not think)

`split` takes the whole output so far; reasoning and content only grow as it does (a partial marker
at the end is held back), so streamed deltas add up to the complete answer.
"""

from __future__ import annotations

from typing import ClassVar

from radixmesh.common.registry import LazyRegistry
from radixmesh.gateway.tools.base import held_back

START, END = "<think>", "</think>"


class ReasoningParser:
    """`<think>` style reasoning; subclasses say whether the answer starts inside it."""

    id: ClassVar[str]
    starts_thinking: ClassVar[bool]
    """Without an opening `<think>` the output is still reasoning until `</think>`."""
    end = END

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the output so far: reasoning trimmed, content without leading whitespace."""
        head = text.lstrip()
        if not final and len(head) < len(START) and START.startswith(head):
            return "", ""  # maybe the opening marker
        if head.startswith(START):
            body = head[len(START):]
        elif self.starts_thinking:
            body = text
        else:
            return "", text.lstrip()
        close = body.find(END)
        if close < 0:
            thinking = body if final else body[:len(body) - held_back(body, END)]
            return thinking.strip(), ""
        return body[:close].strip(), body[close + len(END):].lstrip()


class DeepSeekR1Parser(ReasoningParser):
    id = "deepseek-r1"
    starts_thinking = True


class Qwen3Parser(ReasoningParser):
    id = "qwen3"
    starts_thinking = False


REASONING_PARSERS: LazyRegistry[type[ReasoningParser]] = LazyRegistry("reasoning parser", {
    "deepseek-r1": "radixmesh.gateway.reasoning:DeepSeekR1Parser",
    "qwen3": "radixmesh.gateway.reasoning:Qwen3Parser",
}, param="reasoning_parser")
"""--reasoning-parser id -> its class."""


def check_reasoning_parser(name: str) -> str:
    key = name.replace("_", "-").lower()
    REASONING_PARSERS.check(key)
    return key


def reasoning_parser(name: str) -> ReasoningParser:
    return REASONING_PARSERS.load(check_reasoning_parser(name))()
