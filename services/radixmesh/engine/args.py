"""The engine's command-line flags: the model flags every command that loads a model takes, and one flag per
`EngineConfig` field (kebab-case), documented by the field's docstring."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
from typing import Any

MODEL_FLAGS = ("model", "load_format", "tokenizer", "dtype", "context_length")
"""Destinations of the model flags: the same on every command that loads a model or its tokenizer."""
_SKIP_FLAGS = {*MODEL_FLAGS, "log_level", "kv_events_block_size"}


def add_model_args(parser: argparse.ArgumentParser, tokenizer_only: bool = False) -> None:
    """The model flags (`--model`, `--load-format`, `--tokenizer`, `--dtype`, `--context-length`).

    Every command that loads a model or its tokenizer takes them, so one set of flags (for instance
    `radixmesh cluster up`'s) can be handed to each service unchanged. `tokenizer_only` services
    load no weights: they accept the weight flags (`--dtype`, `--context-length`) and ignore them.
    """
    from radixmesh.engine.config import DTYPES, LOAD_FORMATS

    unused = " (accepted for uniformity; this command loads no weights)" if tokenizer_only else ""
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=None,
                       help="model name (smollm2-135m, the default), HF directory or .gguf file; with "
                            "--load-format dummy also a named shape such as llama-3.1-8b, or a directory holding "
                            "only config.json (and tokenizer files)")
    group.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                       help="auto | safetensors | gguf | dummy (random weights of the model's shape)"
                            + (": with dummy no checkpoint files are needed" if tokenizer_only else ""))
    group.add_argument("--tokenizer", default=None,
                       help="tokenizer directory, Hugging Face hub id or default-model name, when it is not the "
                            "model's own (default: the model's tokenizer)")
    group.add_argument("--dtype", default="auto", choices=DTYPES,
                       help="auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16" + unused)
    group.add_argument("--context-length", type=int, default=None,
                       help="override the model's context length (max prompt + output tokens)" + unused)


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The model flags of parsed `args`, keyed like EngineConfig's fields."""
    return {name: getattr(args, name) for name in MODEL_FLAGS}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The model flags, then one flag per other EngineConfig field (kebab-case), help from the field docstrings."""
    from radixmesh.engine.config import EngineConfig

    add_model_args(parser)
    docs = field_docs(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        if field.name in _SKIP_FLAGS:
            continue
        flag = "--" + field.name.replace("_", "-")
        help_text = docs.get(field.name, "")
        if field.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help=help_text)
            continue
        if str(field.type) == "tuple[str, ...]":
            parser.add_argument(flag, nargs="*", default=[], help=help_text)
            continue
        kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(field.type), str)
        parser.add_argument(flag, type=kind, default=field.default, help=help_text)
    parser.add_argument("--disable-overlap-schedule", dest="overlap_schedule", action="store_const", const="off",
                        help="same as --overlap-schedule off")
    parser.add_argument("--log-level", default="warning", help="logging level of the engine")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags of parsed `args`, keyed like EngineConfig's fields."""
    from radixmesh.engine.config import EngineConfig

    return {name: getattr(args, name) for name in EngineConfig.field_names() if hasattr(args, name)}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring under it in `cls`'s source (parsed once per class: every command that takes
    engine flags asks again). Callers must not modify the dict."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value).replace("%", "%%")
    return docs
