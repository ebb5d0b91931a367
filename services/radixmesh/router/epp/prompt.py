"""The prompt of a request body, as the tokenizer service takes it (no tokenizer here).

Bodies are recognised by their shape, whatever the path: OpenAI chat (`messages`), OpenAI completions
(`prompt`: text, token ids, or a batch of either), SGLang's native /generate (`text` or `input_ids`).
A batch is picked by its first prompt (the whole batch goes to one worker). Chat messages become what the
gateway renders with the chat template (roles as the gateway maps them, text parts joined by newlines);
anything the picker cannot read exactly as the model server will (images, tools, bad JSON) has no prompt,
and the request is picked by load alone: the model server still answers it, or refuses it, itself. The model it
names (OpenAI `model`, or SGLang's `lora_path` for a LoRA adapter) comes along: the picker sends a request of an
adapter to a worker holding it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
"""OpenAI roles and what the chat template gets (radixmesh.gateway.openai_convert.CHAT_ROLES)."""


@dataclass(frozen=True)
class PromptInput:
    """One prompt: text, a conversation, or token ids; or none, and why."""

    kind: str
    """text | chat | ids | none."""
    text: str = ""
    """kind text: the raw prompt (special tokens are added as the server adds them)."""
    messages: tuple[tuple[str, str], ...] = ()
    """kind chat: (role, content) pairs, for the model's chat template."""
    token_ids: tuple[int, ...] = ()
    """kind ids: the prompt's token ids, as the client sent them."""
    reason: str = ""
    """kind none: why there is no prompt to look up."""
    model: str = ""
    """The model or LoRA adapter the body names: `lora_path` (the first of a batch), else OpenAI's `model`
    ("base:adapter" or a bare name); "" when it names none."""


def none(reason: str) -> PromptInput:
    return PromptInput("none", reason=reason)


def prompt_of(body: bytes) -> PromptInput:
    """The prompt of a buffered request body (see the module docstring)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return none("the body is not JSON")
    if not isinstance(data, dict):
        return none("the body is not a JSON object")
    return dataclasses.replace(_prompt(data), model=_model(data))


def _prompt(data: dict[str, Any]) -> PromptInput:
    if "messages" in data:
        return _chat(data["messages"])
    for key in ("prompt", "text", "input_ids"):
        if key in data:
            return _plain(data[key], key)
    return none("no messages, prompt, text or input_ids")


def _model(data: dict[str, Any]) -> str:
    lora = data.get("lora_path")
    if isinstance(lora, list):
        lora = lora[0] if lora else None
    if isinstance(lora, str) and lora:
        return lora
    model = data.get("model")
    return model if isinstance(model, str) else ""


def _plain(value: Any, key: str) -> PromptInput:
    if isinstance(value, list) and value and not _is_ids(value):
        value = value[0]  # a batch: its first prompt
    if isinstance(value, str) and key != "input_ids":
        return PromptInput("text", text=value)
    if isinstance(value, list) and value and _is_ids(value):
        return PromptInput("ids", token_ids=tuple(value))
    return none(f"{key} is neither text nor token ids")


def _is_ids(value: list[Any]) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def _chat(messages: Any) -> PromptInput:
    if not isinstance(messages, list) or not messages:
        return none("messages is not a non-empty list")
    pairs = []
    for message in messages:
        if not isinstance(message, dict) or message.get("tool_calls"):
            return none("a message is not a plain chat message")
        role = CHAT_ROLES.get(message.get("role"))  # type: ignore[arg-type]
        content = _text(message.get("content"))
        if role is None or content is None:
            return none("a message has a role or content the picker does not render")
        pairs.append((role, content))
    return PromptInput("chat", messages=tuple(pairs))


def _text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            return None  # an image or another kind of part
        texts.append(part["text"])
    return "\n".join(texts)
