"""The `radixmesh` command."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from radixmesh.common.errors import RadixMeshError
from radixmesh.common.registry import LazyRegistry
from radixmesh.engine.args import add_engine_args, engine_kwargs


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


COMMANDS: LazyRegistry[Callable[[argparse._SubParsersAction], None]] = LazyRegistry("command", {
    "generate": "radixmesh.cli:register_generate",
    "serve": "radixmesh.gateway.commands:register",
    "gateway": "radixmesh.gateway.commands:register",
    "tokenizer": "radixmesh.tokenizer_service.commands:register",
    "worker": "radixmesh.worker.commands:register",
    "router": "radixmesh.router.commands:register",
    "grammar": "radixmesh.grammar_service.commands:register",
    "cluster": "radixmesh.cluster.commands:register",
    "bench": "loadtests.commands:register",
})
"""Command -> "module:function" that adds it (and its siblings of the same target) to the subparsers object.
Those modules must import nothing heavy at module level (the CLI starts fast)."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with a known `command`, only that command's part. Every service is a
    process of its own: building the others' flags (and importing their modules) would cost each start
    a few tenths of a second of CPU."""
    parser = argparse.ArgumentParser(prog="radixmesh", description="LLM serving with radix prefix caching")
    sub = parser.add_subparsers(dest="command", required=True)
    first_of_target: dict[str, str] = {}  # one call per function (serve's adds gateway too)
    for name, target in COMMANDS.items():
        first_of_target.setdefault(target, name)
    names = [command] if command is not None and command in COMMANDS else list(first_of_target.values())
    for name in names:
        try:
            COMMANDS.load(name)(sub)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] in ("radixmesh", "loadtests"):
                raise
            continue  # a dependency of that part of the platform is not installed here
    return parser


def register_generate(sub: argparse._SubParsersAction) -> None:
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
