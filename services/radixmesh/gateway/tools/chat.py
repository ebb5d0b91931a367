"""What a chat request's tools and reasoning change: the prompt, the sampling parameters and the output.

    setup = ChatSetup.of(config, card, tool_request, include_reasoning=..., separate_reasoning=...)
    input_ids = backend.apply_chat_template(*setup.template_inputs(messages))
    params = setup.sampling_params(params)       # the structural tag of constrained calls
    output = setup.new_output()                  # one per choice: reasoning, content, calls
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from radixmesh.common.errors import invalid_argument
from radixmesh.gateway.backend import ModelCard, SamplingParams
from radixmesh.gateway.config import GatewayConfig
from radixmesh.gateway.reasoning import ReasoningParser, reasoning_parser
from radixmesh.gateway.tools.base import ToolCallParser
from radixmesh.gateway.tools.constraint import tool_call_tag
from radixmesh.gateway.tools.output import ChoiceOutput
from radixmesh.gateway.tools.prompt import ChatMessages, has_tool_turns, template_inputs
from radixmesh.gateway.tools.registry import parser_for_model, tool_parser
from radixmesh.gateway.tools.request import ToolRequest


@dataclass(frozen=True)
class ChatSetup:
    """One chat request's tool and reasoning handling."""

    parser: ToolCallParser
    """The served model's tool-call syntax (used for the prompt even when no tools are requested)."""
    tools: ToolRequest | None
    """The tools the model may call now (None: it answers in text; tool turns may still be in the history)."""
    takes_tools: bool
    """The chat template renders tools itself."""
    strict: bool
    """--strict-tools: constrain tool_choice auto too."""
    reasoning: ReasoningParser | None
    include_reasoning: bool

    @classmethod
    def of(cls, config: GatewayConfig, card: ModelCard, tools: ToolRequest | None, include_reasoning: bool = True,
           separate_reasoning: bool = True) -> ChatSetup:
        names = [card.name, *sorted(card.aliases), card.model_path, card.tokenizer_path]
        parser_id = parser_for_model(config.tool_call_parser, card.chat_template_tool_syntax, names)
        reasoning = reasoning_parser(config.reasoning_parser) if config.reasoning_parser and separate_reasoning \
            else None
        return cls(tool_parser(parser_id), tools, card.chat_template_takes_tools, config.strict_tools, reasoning,
                   include_reasoning)

    def template_inputs(self, messages: ChatMessages) -> tuple[ChatMessages, list[dict[str, Any]] | None]:
        """The messages and `tools` for the chat template."""
        if self.tools is None and not has_tool_turns(messages):
            return messages, None
        return template_inputs(messages, self.tools.tools if self.tools else [], self.parser, self.takes_tools)

    @property
    def constrained(self) -> bool:
        return self.tools is not None and (self.tools.constrained or self.strict)

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """`params` with the structural tag of constrained calls, and special tokens kept where the syntax
        needs them."""
        if self.tools is None:
            return params
        changes: dict[str, Any] = {}
        if self.parser.keeps_special_tokens:
            changes["skip_special_tokens"] = False
        if self.constrained:
            self.check_no_grammar(params.has_grammar)
            changes["structural_tag"] = tool_call_tag(self.parser.syntax, self.tools.tools, self.tools.choice,
                                                      self.tools.parallel,
                                                      self.reasoning.end if self.reasoning is not None else None)
        return msgspec.structs.replace(params, **changes) if changes else params

    def check_no_grammar(self, has_grammar: bool) -> None:
        """Constrained calls and another output constraint exclude each other (400 naming tool_choice)."""
        if has_grammar and self.constrained:
            raise invalid_argument("tool_choice required or a named function (or --strict-tools) constrains the "
                                   "output to tool calls; it cannot be combined with response_format, json_schema, "
                                   "regex or ebnf", "tool_choice")

    def new_output(self) -> ChoiceOutput:
        if self.tools is None:
            return ChoiceOutput(self.reasoning, None, self.include_reasoning)
        return ChoiceOutput(self.reasoning, self.parser, self.include_reasoning, None if self.tools.parallel else 1)
