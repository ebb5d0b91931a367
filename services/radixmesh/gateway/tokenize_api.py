"""Text helpers for clients: `/tokenize` and `/apply_chat_template`.

Clients that reason about token boundaries or chat markup (the `radixmesh.lang` frontend
scoring `select` choices and opening role blocks) ask the server rather than loading a
tokenizer themselves, so they work against any gateway, local or remote.

- `POST /tokenize {"prompt": str | [str, ...]}` -> `{"tokens", "count", "max_model_len"}`:
  the ids `/generate` would run for that `text` (lists for a list of prompts, as in SGLang).
- `POST /apply_chat_template {"messages": [...], "add_generation_prompt": bool}` ->
  `{"text"}`: the conversation rendered in the model's chat template.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixmesh.gateway import openai_convert as conv
from radixmesh.gateway.protocol import ChatMessage, RequestBody, parse_body
from radixmesh.gateway.state import get_state

router = APIRouter(tags=["native"])


class TokenizeRequest(RequestBody):
    prompt: str | list[str]


class ChatTemplateRequest(RequestBody):
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    """End with the opening of the assistant's turn."""


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    state = get_state(request)
    req = parse_body(await request.body(), TokenizeRequest)
    body: dict[str, Any] = {"max_model_len": state.backend.card.context_len}
    if isinstance(req.prompt, str):
        tokens = await state.backend.encode(req.prompt)
        body.update(tokens=tokens, count=len(tokens))
    else:
        batch = list(await asyncio.gather(*(state.backend.encode(text) for text in req.prompt)))
        body.update(tokens=batch, count=[len(ids) for ids in batch])
    return JSONResponse(body)


@router.post("/apply_chat_template")
async def apply_chat_template(request: Request) -> Response:
    state = get_state(request)
    req = parse_body(await request.body(), ChatTemplateRequest)
    text = await state.backend.render_chat(conv.chat_messages(req.messages), req.add_generation_prompt)
    return JSONResponse({"text": text})
