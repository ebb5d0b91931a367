"""A tokenizer as files: what the tokenizer service sends, and what a client loads back from them."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.hf_tokenizer import load_tokenizer
from radixmesh.wire.fingerprint import tokenizer_fingerprint


def saved_files(tokenizer: Any) -> list[tuple[str, bytes]]:
    """(name, content) of every file `save_pretrained` writes for `tokenizer`, in name order."""
    with tempfile.TemporaryDirectory(prefix="radixmesh-tokenizer-") as directory:
        tokenizer.save_pretrained(directory)
        return [(path.name, path.read_bytes()) for path in sorted(Path(directory).iterdir()) if path.is_file()]


def load_from_files(files: list[tuple[str, bytes]], fingerprint: str) -> Any:
    """The tokenizer those files describe, checked against the fingerprint its service reports (a copy that
    tokenizes or decodes differently is refused, not used)."""
    if not files:
        raise invalid_argument("the tokenizer service sent no tokenizer files", "files")
    with tempfile.TemporaryDirectory(prefix="radixmesh-tokenizer-") as directory:
        for name, data in files:
            if not name or Path(name).name != name or name in (".", ".."):
                raise invalid_argument(f"tokenizer file name {name!r} is not a plain file name", "files")
            (Path(directory) / name).write_bytes(data)
        tokenizer = load_tokenizer(directory)
    got = tokenizer_fingerprint(tokenizer)
    if got != fingerprint:
        raise invalid_argument(f"the tokenizer loaded from the service's files has fingerprint {got[:12]}..., "
                               f"the service reports {fingerprint[:12]}...", "files")
    return tokenizer
