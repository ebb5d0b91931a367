"""Tokenize requests that carry images (TokenizeRequest.images): read, preprocess and place them."""

from __future__ import annotations

import asyncio
from typing import Any

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.mm.prompt import (
    ChatMessages,
    MultimodalProcessor,
    MultimodalPrompt,
    PromptWithImages,
    text_only_error,
)
from radixmesh.protocol import tokenizer_pb2
from radixmesh.wire.chat_convert import tool_turn_fields
from radixmesh.wire.convert import image_sources_from_proto


def chat_messages(chat: tokenizer_pb2.ChatConversation) -> ChatMessages:
    """The conversation's messages; a message with content parts keeps them ({"type": "text" | "image"})."""
    out: ChatMessages = []
    for m in chat.messages:
        if not m.parts:
            out.append({"role": m.role, "content": m.content, **tool_turn_fields(m)})
            continue
        parts: list[dict[str, Any]] = []
        for part in m.parts:
            kind = part.WhichOneof("part")
            if kind == "text":
                parts.append({"type": "text", "text": part.text})
            elif kind == "image" and part.image:
                parts.append({"type": "image"})
            else:
                raise invalid_argument("a ChatContentPart needs text or image", "messages")
        out.append({"role": m.role, "content": parts})
    return out


def text_only(messages: ChatMessages) -> list[dict[str, Any]]:
    """Messages whose parts hold no image, their text parts joined by newlines (as the gateway joins them);
    tool fields kept."""
    out = []
    for m in messages:
        content = m["content"]
        if not isinstance(content, str):
            if any(part["type"] == "image" for part in content):
                raise invalid_argument("a chat message has an image part but the request carries no images",
                                       "messages")
            content = "\n".join(str(part["text"]) for part in content)
        out.append({**m, "content": content})
    return out


async def tokenize_with_images(processor: MultimodalProcessor | None, request: tokenizer_pb2.TokenizeRequest,
                               model_name: str) -> MultimodalPrompt:
    """Token ids with each image placeholder expanded, and the preprocessed images (off the event loop)."""
    sources = image_sources_from_proto(request.images)
    if processor is None:
        raise text_only_error(model_name, sources)
    kind = request.WhichOneof("input")
    if kind == "chat":
        add_prompt = request.chat.add_generation_prompt if request.chat.HasField("add_generation_prompt") else True
        prompt = PromptWithImages(sources, messages=chat_messages(request.chat), add_generation_prompt=add_prompt)
    elif kind == "text":
        prompt = PromptWithImages(sources, text=request.text)
    elif kind == "token_ids":
        prompt = PromptWithImages(sources, input_ids=list(request.token_ids.ids))
    else:
        raise invalid_argument("a Tokenize request needs `text`, `chat` or `token_ids`", "input")
    return await asyncio.to_thread(processor.prepare, prompt)
