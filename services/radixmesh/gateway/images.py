"""Images in HTTP requests: OpenAI chat `image_url` content parts and SGLang's native `image_data`,
turned into `PromptWithImages` for `GatewayBackend.tokenize_multimodal` (which reads and places them)."""

from __future__ import annotations

from typing import Any

from radixmesh.common.errors import invalid_argument, unsupported
from radixmesh.engine.mm.loading import image_sources
from radixmesh.engine.mm.prompt import ChatMessages, MultimodalPrompt, PromptWithImages
from radixmesh.gateway.openai_convert import CHAT_ROLES
from radixmesh.gateway.protocol import ChatMessage, ContentPart
from radixmesh.protocol import tokenizer_pb2
from radixmesh.wire.convert import image_sources_to_proto, images_from_proto
from radixmesh.wire.images import ImageSource

_TEXT_TYPES = ("text", "input_text")
_IMAGE_TYPES = ("image_url", "input_image")


def has_images(messages: list[ChatMessage]) -> bool:
    return any(isinstance(m.content, list) and any(p.type in _IMAGE_TYPES for p in m.content) for m in messages)


def chat_with_images(messages: list[ChatMessage]) -> tuple[ChatMessages, list[ImageSource]]:
    """Messages whose content keeps its parts ({"type": "text"} or {"type": "image"}, in order) and the
    images in the order of their parts, each named by where it sits (messages[i].content[j].image_url)."""
    out: ChatMessages = []
    sources: list[ImageSource] = []
    for i, msg in enumerate(messages):
        role = CHAT_ROLES.get(msg.role)
        if role is None:
            raise unsupported(f"messages[{i}].role {msg.role!r} is not supported (use system, user or assistant)",
                              "messages")
        if msg.tool_calls:
            raise unsupported(f"messages[{i}] has tool_calls; tools are not supported yet", "messages")
        if msg.content is None or isinstance(msg.content, str):
            out.append({"role": role, "content": msg.content or ""})
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(msg.content):
            parts.append(_part(part, f"messages[{i}].content[{j}]", sources))
        out.append({"role": role, "content": parts})
    return out, sources


def _part(part: ContentPart, where: str, sources: list[ImageSource]) -> dict[str, Any]:
    if part.type in _TEXT_TYPES:
        if part.text is None:
            raise invalid_argument(f"{where} of type {part.type!r} needs 'text'", "messages")
        return {"type": "text", "text": part.text}
    if part.type in _IMAGE_TYPES:
        url = part.image_url if isinstance(part.image_url, str) else part.image_url.url if part.image_url else None
        if not url:
            raise invalid_argument(f"{where} of type {part.type!r} needs 'image_url' with a 'url'",
                                   f"{where}.image_url")
        sources.append(ImageSource(f"{where}.image_url", url=url))
        return {"type": "image"}
    raise unsupported(f"{where} has a content part of type {part.type!r}; only text and image_url are supported",
                      "messages")


def native_image_sources(image_data: Any, num_prompts: int, batched: bool) -> list[list[ImageSource]]:
    """SGLang's `image_data` per prompt: for one prompt an image or a list of them; for a batch, one such
    entry (or null) per prompt."""
    if image_data is None:
        return [[] for _ in range(num_prompts)]
    if not batched:
        return [image_sources(_checked(image_data, "image_data"), "image_data")]
    if not isinstance(image_data, list) or len(image_data) != num_prompts:
        raise invalid_argument(f"image_data must be a list with one entry per prompt ({num_prompts})", "image_data")
    return [image_sources(_checked(item, f"image_data[{i}]"), f"image_data[{i}]") if item is not None else []
            for i, item in enumerate(image_data)]


def _checked(item: Any, param: str) -> str | list[str | bytes]:
    items = item if isinstance(item, list) else [item]
    if not items or not all(isinstance(x, str) for x in items):
        raise invalid_argument(f"{param} must be a base64 image, a data: URL or a list of them", param)
    return item


def tokenize_request(prompt: PromptWithImages, block_size: int) -> tokenizer_pb2.TokenizeRequest:
    """The tokenizer service's Tokenize request of a prompt with images (the grpc backend's path)."""
    request = tokenizer_pb2.TokenizeRequest(block_size=block_size, images=image_sources_to_proto(prompt.images))
    if prompt.messages is not None:
        chat = [_chat_message(m) for m in prompt.messages]
        request.chat.CopyFrom(tokenizer_pb2.ChatConversation(messages=chat,
                                                             add_generation_prompt=prompt.add_generation_prompt))
    elif prompt.text is not None:
        request.text = prompt.text
    else:
        request.token_ids.CopyFrom(tokenizer_pb2.TokenIdList(ids=list(prompt.input_ids or [])))
    return request


def _chat_message(message: dict[str, Any]) -> tokenizer_pb2.ChatMessage:
    content = message["content"]
    if isinstance(content, str):
        return tokenizer_pb2.ChatMessage(role=message["role"], content=content)
    parts = [tokenizer_pb2.ChatContentPart(image=True) if part["type"] == "image"
             else tokenizer_pb2.ChatContentPart(text=str(part["text"])) for part in content]
    return tokenizer_pb2.ChatMessage(role=message["role"], parts=parts)


def tokenized_prompt(response: tokenizer_pb2.TokenizeResponse) -> MultimodalPrompt:
    return MultimodalPrompt(list(response.token_ids), images_from_proto(response.images), response.prompt_text)
