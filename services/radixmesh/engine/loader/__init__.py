"""Model loading: turn `--model` / `--load-format` into a config, a weight stream and a tokenizer.

Load formats (the ids of `--load-format`):

- `safetensors`: a Hugging Face directory (single file or sharded with an index).
- `gguf`: a `.gguf` file, or the default model (itself shipped as GGUF); converted once
  into a safetensors directory in the cache, then read as `safetensors`.
- `dummy`: random weights of a named shape (`NAMED_SHAPES`), a model directory or a
  config.json; fill the model with `init_dummy_` instead of calling `iter_weights`.
- `auto`: `gguf` for `.gguf` files and the default model, `safetensors` for directories.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from radixmesh.common.errors import RadixMeshError, invalid_argument, not_found
from radixmesh.engine.loader.default_model import (
    DEFAULT_MODEL_ALIASES,
    DEFAULT_MODEL_NAME,
    _looks_like_hub_id,
    ensure_default_model,
    resolve_model_path,
)
from radixmesh.engine.loader.dummy import NAMED_SHAPES, init_dummy_, named_shape_config
from radixmesh.engine.loader.safetensors_loader import (
    SafetensorsSlice,
    iter_safetensors_slices,
    iter_safetensors_weights,
    safetensors_files,
)
from radixmesh.engine.model_config import ModelConfig

if TYPE_CHECKING:  # torch is imported where weights are read: preparing a model (services without a model
    import torch  # on this machine, such as the tokenizer service) needs none of it

LOAD_FORMATS = frozenset({"auto", "safetensors", "gguf", "dummy"})
"""Accepted values of `--load-format`."""
DEFAULT_TOKENIZER_VOCAB_SIZE = 49152
"""Vocabulary of the default model's tokenizer, lent to dummy shapes at least this wide."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedModel:
    """A model ready to build: its shape, where its weights are, and which tokenizer serves it."""

    name: str
    """Served model name, e.g. smollm2-135m-instruct, a directory's name or a named shape."""
    config: ModelConfig
    """Shape and numerics of the model."""
    load_format: str
    """Resolved load format: safetensors | gguf | dummy (never auto)."""
    model_path: Path | None
    """Hugging Face directory (config.json + safetensors); None for dummy named shapes."""
    tokenizer_path: Path | str | None
    """Directory with the tokenizer files, or a Hugging Face hub id given as `tokenizer`. For dummy
    named shapes it is the default model's directory when the shape's vocabulary is at least as
    wide as that tokenizer's (token ids the model samples beyond it do not decode); None when no
    tokenizer fits: callers then accept only token-id prompts."""


def prepare_model(model: str | None, load_format: str = "auto", progress: bool = True,
                  lend_tokenizer: bool = True, tokenizer: str | None = None,
                  need_weights: bool = True) -> PreparedModel:
    """Resolve `model` (name, directory, .gguf file or named shape) under `load_format`.

    Downloads and converts the default model on first use. Every user-facing failure is a
    RadixMeshError with one line (missing path, unsupported architecture, corrupt file).
    `lend_tokenizer=False` keeps dummy shapes without a tokenizer (benchmarks feed token ids).
    `tokenizer` (a directory, hub id or default-model name) replaces the model's own tokenizer.
    `need_weights=False` (services that only tokenize) accepts a directory without checkpoint files.
    """
    if load_format not in LOAD_FORMATS:
        known = ", ".join(sorted(LOAD_FORMATS))
        raise invalid_argument(f"unknown load format {load_format!r} (known: {known})", "load_format")
    if load_format == "dummy":
        prepared = _prepare_dummy(model, progress, lend_tokenizer and not tokenizer)
    else:
        prepared = _prepare_checkpoint(model, load_format, progress, need_weights)
    if tokenizer:
        prepared = dataclasses.replace(prepared, tokenizer_path=resolve_tokenizer(tokenizer, progress))
    return prepared


def _prepare_checkpoint(model: str | None, load_format: str, progress: bool, need_weights: bool) -> PreparedModel:
    from_gguf = model is None or model.lower() in DEFAULT_MODEL_ALIASES or model.lower().endswith(".gguf")
    if load_format == "gguf" and not from_gguf:
        raise invalid_argument(f"load format gguf needs a .gguf file, got {model!r}", "load_format")
    if load_format == "safetensors" and model is not None and model.lower().endswith(".gguf"):
        raise invalid_argument(f"load format safetensors cannot read {model!r}; use gguf or auto",
                               "load_format")
    name, path = resolve_model_path(model, progress)
    config = ModelConfig.from_dir(path)
    if need_weights:
        safetensors_files(path)  # fail here, before the model is built, when weights are missing
    return PreparedModel(name, config, "gguf" if from_gguf else "safetensors", path, _tokenizer_dir(path))


def resolve_tokenizer(tokenizer: str, progress: bool = True) -> Path | str:
    """A `--tokenizer` value: a directory holding tokenizer files, the default model's name, or a
    Hugging Face hub id (returned as is: the tokenizer loads through the Hugging Face cache)."""
    if tokenizer.lower() in DEFAULT_MODEL_ALIASES:
        return ensure_default_model(progress)
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        if _tokenizer_dir(path) is None:
            raise not_found(f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {path}")
        return path.resolve()
    if _looks_like_hub_id(tokenizer):
        return tokenizer
    raise not_found(f"tokenizer {tokenizer!r} not found: not a directory with tokenizer files, a Hugging Face "
                    f"hub id (org/name) or the default model's name")


def iter_weights(prepared: PreparedModel, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """`(hf_name, tensor)` pairs of a prepared non-dummy model, read from its safetensors."""
    if prepared.load_format == "dummy" or prepared.model_path is None:
        raise invalid_argument("dummy models have no checkpoint; fill them with init_dummy_", "load_format")
    return iter_safetensors_weights(prepared.model_path, progress)


def iter_weight_slices(prepared: PreparedModel, progress: bool = True) -> Iterator[tuple[str, SafetensorsSlice]]:
    """`(hf_name, lazy tensor)` pairs: a tensor-parallel rank reads only its shards (GGUF models load
    from their converted safetensors)."""
    if prepared.load_format == "dummy" or prepared.model_path is None:
        raise invalid_argument("dummy models have no checkpoint; fill them with init_dummy_", "load_format")
    return iter_safetensors_slices(prepared.model_path, progress)


def _prepare_dummy(model: str | None, progress: bool, lend_tokenizer: bool) -> PreparedModel:
    key = "smollm2-135m" if model is None or model.lower() in DEFAULT_MODEL_ALIASES else model.lower()
    if key in NAMED_SHAPES:
        config = named_shape_config(key)
        tokenizer = _default_tokenizer_for(config, progress) if lend_tokenizer else None
        return PreparedModel(key, config, "dummy", None, tokenizer)
    path = Path(model or "").expanduser()
    if path.is_file() and path.suffix == ".json":
        config = ModelConfig.from_hf_dict(_read_json(path))
        path = path.parent
    elif path.is_dir():
        config = ModelConfig.from_dir(path)
    else:
        raise not_found(f"dummy model {model!r} not found: not a model directory, a config.json or a "
                        f"named shape ({', '.join(sorted(NAMED_SHAPES))})")
    tokenizer = _tokenizer_dir(path) or (_default_tokenizer_for(config, progress) if lend_tokenizer else None)
    return PreparedModel(path.resolve().name, config, "dummy", path, tokenizer)


def _read_json(path: Path) -> dict:
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid_argument(f"corrupt config file {path}: {exc}") from None
    if not isinstance(cfg, dict):
        raise invalid_argument(f"corrupt config file {path}: not a JSON object")
    return cfg


def _tokenizer_dir(path: Path) -> Path | None:
    return path if any((path / f).is_file() for f in _TOKENIZER_FILES) else None


def _default_tokenizer_for(config: ModelConfig, progress: bool) -> Path | None:
    if config.vocab_size < DEFAULT_TOKENIZER_VOCAB_SIZE:
        return None
    try:
        return ensure_default_model(progress)
    except RadixMeshError as exc:
        logger.warning("dummy model runs without a tokenizer (default model unavailable: %s)", exc)
        return None


__all__ = [
    "DEFAULT_MODEL_NAME",
    "LOAD_FORMATS",
    "NAMED_SHAPES",
    "PreparedModel",
    "ensure_default_model",
    "init_dummy_",
    "iter_weight_slices",
    "iter_weights",
    "prepare_model",
    "resolve_model_path",
    "resolve_tokenizer",
]
