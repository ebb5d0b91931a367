"""A tokenizer's identity: equal fingerprints tokenize (and template chats) identically."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hex sha256 over the serialized vocabulary/merges/normalizers and the chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        body = backend.to_str()
    else:  # slow (Python) tokenizers: the vocabulary and the added tokens
        body = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    digest = hashlib.sha256()
    for part in (body, str(getattr(tokenizer, "chat_template", None) or "")):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()
