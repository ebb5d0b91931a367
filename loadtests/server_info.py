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


def tokenizer_dir(explicit: str | None, base_url: str | None) -> tuple[str, str]:
    """(tokenizer path or id, where it came from): --tokenizer, else the server's
    GET /model_info `tokenizer_path` or `model_path` when a local directory, else the default model."""
    if explicit:
        return explicit, "--tokenizer"
    if base_url:
        info = get_json(base_url.rstrip("/") + "/model_info")
        for key in ("tokenizer_path", "model_path"):
            path = info.get(key) if isinstance(info, dict) else None
            if isinstance(path, str) and Path(path).is_dir():
                return path, f"{base_url}/model_info {key}"
    from radixmesh.engine.loader.default_model import ensure_default_model

    return str(ensure_default_model(progress=False)), "the default model"


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
