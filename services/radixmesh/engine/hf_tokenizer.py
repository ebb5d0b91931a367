"""Loading the tokenizer that ships with a model directory."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from radixmesh.common.errors import invalid_argument

GENERIC_FAST_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
"""`tokenizer_class` values that name transformers' generic fast tokenizer (its v4 and v5 names)."""


def names_generic_fast_tokenizer(path: str | Path) -> bool:
    """Whether `path` is a local directory whose tokenizer is transformers' generic fast tokenizer over its
    tokenizer.json. AutoTokenizer would build that same class, but finding it imports torch and the model
    registry (~3 s of CPU per process start on a small machine); the class itself needs neither."""
    directory = Path(path)
    if not (directory / "tokenizer.json").is_file():
        return False
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("tokenizer_class") in GENERIC_FAST_CLASSES


def pretrained_tokenizer(path: str | Path) -> Any:
    """transformers' tokenizer of a model directory or hub id (exceptions as from_pretrained raises them)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if names_generic_fast_tokenizer(path):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_tokenizer(path: str | Path) -> Any:
    try:
        return pretrained_tokenizer(path)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ... for broken files
        detail = str(exc) or type(exc).__name__
        raise invalid_argument(f"cannot load the tokenizer from {path}: {detail}".splitlines()[0]) from None


# The text <-> ids conventions of every front end (HTTP gateway, tokenizer service), in one place.
def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a raw prompt, with the special tokens the model expects at its start."""
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None) -> str:
    """A conversation in the model's chat template, ready for the assistant's turn.

    `tools` (OpenAI's `[{"type": "function", "function": {...}}]`) go to the template as its `tools`
    variable, with messages' tool calls in the shape templates read (`chat_template.template_messages`);
    only for templates that take tools (`chat_template.takes_tools`).
    """
    from radixmesh.engine.chat_template import template_messages

    if not getattr(tokenizer, "chat_template", None):
        raise invalid_argument("this model has no chat template; use /v1/completions", "messages")
    extra: dict[str, Any] = {"tools": tools} if tools else {}
    if tools or any(m.get("tool_calls") or m.get("tool_call_id") for m in messages):
        messages = template_messages(messages)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **extra)
    except Exception as exc:  # jinja2 raises its own errors for conversations a template rejects
        raise invalid_argument(f"the chat template rejected the messages: {exc}", "messages") from None
    return str(text)


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of a rendered conversation (the template writes the special tokens)."""
    return list(tokenizer.encode(render_chat(tokenizer, messages, add_generation_prompt, tools),
                                 add_special_tokens=False))


def decode_text(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    return str(tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))


def token_texts(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """Each token's own text (special tokens kept), for logprobs."""
    return [str(t) for t in tokenizer.batch_decode([[tid] for tid in token_ids], skip_special_tokens=False)]
