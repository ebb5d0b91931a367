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
