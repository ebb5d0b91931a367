"""The `radixmesh` command."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import sys
from typing import Any

from radixmesh.common.errors import RadixMeshError

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
    docs = _field_docs(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        if field.name in _SKIP_FLAGS:
            continue
        flag = "--" + field.name.replace("_", "-")
        help_text = docs.get(field.name, "")
        if field.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help=help_text)
            continue
        kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(field.type), str)
        parser.add_argument(flag, type=kind, default=field.default, help=help_text)
    parser.add_argument("--disable-overlap-schedule", dest="overlap_schedule", action="store_const", const="off",
                        help="same as --overlap-schedule off")
    parser.add_argument("--log-level", default="warning", help="logging level of the engine")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from radixmesh.engine.config import EngineConfig

    return {name: getattr(args, name) for name in EngineConfig.field_names() if hasattr(args, name)}


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
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


def cmd_generate(args: argparse.Namespace) -> int:
    from radixmesh.engine.engine import Engine

    params = {"max_new_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p}
    if args.seed is not None:
        params["seed"] = args.seed
    with Engine(**engine_kwargs(args)) as engine:
        has_template = bool(getattr(engine.tokenizer, "chat_template", None))
        prompt: str | list[int] = args.prompt
        if has_template and not args.raw:
            prompt = engine.apply_chat_template([{"role": "user", "content": args.prompt}])
        if args.stream:
            for chunk in engine.generate_stream(prompt, params):
                print(chunk["text"], end="", flush=True)
            print()
            return 0
        result = engine.generate(prompt, params)
        assert isinstance(result, dict)
        print(result["text"])
        if args.verbose:
            print(result["meta_info"], file=sys.stderr)
    return 0


# Subcommands living in other packages: "module:function" taking the subparsers object, and the commands it adds.
# Those modules must import nothing heavy at module level (the CLI starts fast).
EXTERNAL_COMMANDS = {
    "radixmesh.gateway.commands:register": ("serve", "gateway"),
    "radixmesh.tokenizer.commands:register": ("tokenizer",),
    "radixmesh.worker.commands:register": ("worker",),
    "radixmesh.router.commands:register": ("router",),
    "radixmesh.grammar.commands:register": ("grammar",),
    "radixmesh.cluster.commands:register": ("cluster",),
    "loadtests.commands:register": ("bench",),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with a known `command`, only that command's part. Every service is a
    process of its own: building the others' flags (and importing their modules) would cost each start
    a few tenths of a second of CPU."""
    import importlib

    parser = argparse.ArgumentParser(prog="radixmesh", description="LLM serving with radix prefix caching")
    sub = parser.add_subparsers(dest="command", required=True)
    known = command == "generate" or any(command in names for names in EXTERNAL_COMMANDS.values())
    if not known or command == "generate":
        _register_generate(sub)
    for target, names in EXTERNAL_COMMANDS.items():
        if known and command not in names:
            continue
        module, _, func = target.partition(":")
        try:
            getattr(importlib.import_module(module), func)(sub)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] in ("radixmesh", "loadtests"):
                raise
            continue  # a dependency of that part of the platform is not installed here
    return parser


def _register_generate(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate one completion and print it")
    gen.add_argument("--prompt", required=True, help="the user's message (or raw text with --raw)")
    gen.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    gen.add_argument("--verbose", action="store_true", help="print token counts to stderr")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        code: int = args.func(args)
    except RadixMeshError as exc:
        print(f"radixmesh: error: {exc.message}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    _exit_now_if_a_group_is_stuck(code)
    return code


def _exit_now_if_a_group_is_stuck(code: int) -> None:
    """A tensor-parallel group that could not be left (distributed/leader.py) would abort the interpreter's
    exit; once everything is written, leave without running the remaining destructors."""
    leader = sys.modules.get("radixmesh.engine.distributed.leader")
    if leader is not None:
        leader.close_open_leaders()  # a group the command left open is closed here, where a stuck one is seen
    if leader is not None and getattr(leader, "GROUP_LEFT_UNFINISHED", False):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
