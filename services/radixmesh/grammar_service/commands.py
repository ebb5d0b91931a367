"""`radixmesh grammar`. Imports nothing heavy at module level: the CLI must start fast."""

from __future__ import annotations

import argparse

DEFAULT_PORT = 50054


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `grammar` subcommand to the `radixmesh` command."""
    from radixmesh.common.grpc_server import add_server_args
    from radixmesh.engine.args import add_model_args

    cmd = sub.add_parser("grammar", help="serve the gRPC grammar service (compile structured-output grammars once)",
                         description="Compile JSON-schema, regex and EBNF grammars for the model's tokenizer once "
                                     "per content and share them with every worker (memory LRU + Redis).")
    add_model_args(cmd, tokenizer_only=True)
    cmd.add_argument("--grammar-backend", default="xgrammar", help="grammar backend id (xgrammar)")
    cmd.add_argument("--compile-threads", type=int, default=2, help="threads compiling grammars at once")
    cmd.add_argument("--cache-bytes", type=int, default=256 << 20,
                     help="most bytes of compiled grammars kept in memory (LRU)")
    cmd.add_argument("--cache-ttl-s", type=int, default=7 * 24 * 3600,
                     help="how long compiled grammars live in Redis (with --redis-url)")
    add_server_args(cmd, DEFAULT_PORT)
    cmd.set_defaults(func=cmd_grammar)


def cmd_grammar(args: argparse.Namespace) -> int:
    from radixmesh.common.aio import run_main
    from radixmesh.common.errors import invalid_argument
    from radixmesh.common.grpc_server import server_config, setup_logging
    from radixmesh.grammar_service.server import serve_grammar
    from radixmesh.grammar_service.store import StoreConfig

    if args.compile_threads < 1:
        raise invalid_argument("--compile-threads must be >= 1", "compile_threads")
    setup_logging(args.log_level, "grammar")
    store = StoreConfig(memory_bytes=args.cache_bytes, redis_url=args.redis_url or None, ttl_s=args.cache_ttl_s)
    return run_main(serve_grammar(server_config(args), args.model, args.load_format, store, args.grammar_backend,
                                     args.compile_threads, args.tokenizer))
