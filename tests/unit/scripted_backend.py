"""A fake backend that answers with scripted text (tool calls, reasoning), for the HTTP and gRPC layers."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator

from radixmesh.gateway.backend import GenerationChunk, SamplingParams
from tests.unit.test_gateway_api import FakeBackend

CONTEXT_LEN = 1 << 20


class ScriptedBackend(FakeBackend):
    """Answers each generate call with the next script (the last one repeats), `chunk_chars` characters per
    chunk; each chunk is one token. `max_new_tokens` cuts the script (finish_reason "length")."""

    def __init__(self, *scripts: str, chunk_chars: int = 3, takes_tools: bool = False, tool_syntax: str = "",
                 name: str = "fake-model") -> None:
        super().__init__()
        self._card = dataclasses.replace(self._card, context_len=CONTEXT_LEN, chat_template_takes_tools=takes_tools,
                                         chat_template_tool_syntax=tool_syntax, name=name)
        self.scripts = list(scripts) or [""]
        self.chunk_chars = chunk_chars
        self.calls = 0

    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        params.validate(self._card.vocab_size)

    async def generate(self, input_ids: list[int], params: SamplingParams,
                       rid: str | None = None) -> AsyncGenerator[GenerationChunk, None]:
        self.seen_params.append(params)
        text = self.scripts[min(self.calls, len(self.scripts) - 1)]
        self.calls += 1
        pieces = [text[i:i + self.chunk_chars] for i in range(0, len(text), self.chunk_chars)] or [""]
        pieces = pieces[:params.max_new_tokens]
        cut = len(pieces) == params.max_new_tokens and "".join(pieces) != text
        for i, piece in enumerate(pieces):
            await asyncio.sleep(0)
            last = i == len(pieces) - 1
            reason = ("length" if cut else "stop") if last else None
            yield GenerationChunk(rid or "rid", piece, [i % 26], len(input_ids), 0, i + 1, finish_reason=reason)
