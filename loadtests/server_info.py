"""What the benchmark asks a server before it starts: the model's name and its tokenizer."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

INFO_TIMEOUT_S = 10.0
"""Time allowed to each informational GET."""


def get_json(url: str, timeout_s: float = INFO_TIMEOUT_S) -> Any | None:
    """The JSON body of GET `url`, or None when the server does not answer it."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return json.loads(resp.read().decode("utf-8"))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def served_model(base_url: str) -> str | None:
    """The first model id of GET /v1/models."""
    data = get_json(base_url.rstrip("/") + "/v1/models")
    models = data.get("data") if isinstance(data, dict) else None
    if isinstance(models, list) and models and isinstance(models[0], dict):
        return str(models[0].get("id")) if models[0].get("id") else None
    return None


TOKENIZER_HINT = "pass --tokenizer <directory or Hugging Face name> (the tokenizer the server's model uses)"


def tokenizer_dir(explicit: str | None, base_url: str | None) -> tuple[str, str]:
    """(tokenizer path or hub id, where it came from): --tokenizer, else what the server's GET /model_info
    names: `tokenizer_path` (or `model_path`) when it is a directory here or looks like a hub id.

    Raises ValueError saying what to pass when the server names nothing this machine can load.
    """
    if explicit:
        return explicit, "--tokenizer"
    if not base_url:
        raise ValueError(f"no server to ask for its tokenizer; {TOKENIZER_HINT}")
    url = base_url.rstrip("/") + "/model_info"
    info = get_json(url)
    if not isinstance(info, dict):
        raise ValueError(f"GET {url} did not answer with the model's tokenizer; {TOKENIZER_HINT}")
    named = {key: info.get(key) for key in ("tokenizer_path", "model_path")}
    for key, value in named.items():
        if isinstance(value, str) and value and (Path(value).is_dir() or _looks_like_hub_id(value)):
            return value, f"{url} {key}"
    shown = ", ".join(f"{key} {value!r}" for key, value in named.items())
    raise ValueError(f"GET {url} names no tokenizer on this machine ({shown}); {TOKENIZER_HINT}")


def _looks_like_hub_id(value: str) -> bool:
    parts = value.split("/")
    return len(parts) == 2 and all(parts) and not value.startswith((".", "~")) and not Path(value).exists()


def load_tokenizer(path: str, source: str = "--tokenizer") -> Any:
    """The tokenizer at `path`; ValueError (with what to pass instead) when it cannot be loaded."""
    from radixmesh.engine.hf_tokenizer import pretrained_tokenizer

    try:
        return pretrained_tokenizer(path)
    except (OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        hint = "" if source == "--tokenizer" else f"; {TOKENIZER_HINT}"
        raise ValueError(f"cannot load the tokenizer {path!r} (from {source}): {first}{hint}") from None
