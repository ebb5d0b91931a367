"""Loading the tokenizer that ships with a model directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from radixmesh.common.errors import invalid_argument


def load_tokenizer(path: str | Path) -> Any:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise invalid_argument(f"cannot load the tokenizer from {path}: {exc}".splitlines()[0]) from None


# The text <-> ids conventions of every front end (HTTP gateway, tokenizer service), in one place.
def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a raw prompt, with the special tokens the model expects at its start."""
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def render_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """A conversation in the model's chat template, ready for the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise invalid_argument("this model has no chat template; use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja2 raises its own errors for conversations a template rejects
        raise invalid_argument(f"the chat template rejected the messages: {exc}", "messages") from None
    return str(text)


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a rendered conversation (the template writes the special tokens)."""
    return list(tokenizer.encode(render_chat(tokenizer, messages, add_generation_prompt), add_special_tokens=False))


def decode_text(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    return str(tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))


def token_texts(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """Each token's own text (special tokens kept), for logprobs."""
    return [str(t) for t in tokenizer.batch_decode([[tid] for tid in token_ids], skip_special_tokens=False)]
