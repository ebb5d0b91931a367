"""`radixmesh tokenizer`. Imports nothing heavy at module level: the CLI must start fast."""

from __future__ import annotations

import argparse

from radixmesh.engine.tokenize_pool import DEFAULT_TOKENIZER_WORKERS

DEFAULT_PORT = 50052


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `tokenizer` subcommand to the `radixmesh` command."""
    from radixmesh.common.grpc_server import add_server_args
    from radixmesh.engine.args import add_model_args
    from radixmesh.engine.mm.config import add_image_args

    cmd = sub.add_parser("tokenizer", help="serve the gRPC tokenizer service (tokenize, detokenize, chat templates)",
                         description="Tokenize prompts once at the edge (token ids + block hashes) and "
                                     "detokenize output streams incrementally, over gRPC.")
    add_model_args(cmd, tokenizer_only=True)
    cmd.add_argument("--block-size", type=int, default=16, help="tokens per block of the prompt's block hashes")
    cmd.add_argument("--tokenizer-workers", type=int, default=DEFAULT_TOKENIZER_WORKERS,
                     help="threads that tokenize prompts off the event loop; prompts that arrive while all are busy "
                          "are encoded together, a long prompt in pieces on several (default: %(default)s)")
    add_image_args(cmd)
    add_server_args(cmd, DEFAULT_PORT)
    cmd.set_defaults(func=cmd_tokenizer)


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from radixmesh.common.aio import run_main
    from radixmesh.common.grpc_server import server_config, setup_logging
    from radixmesh.engine.mm.config import image_limits_from_args
    from radixmesh.tokenizer_service.server import serve_tokenizer

    setup_logging(args.log_level, "tokenizer")
    return run_main(serve_tokenizer(server_config(args), args.model, args.load_format, args.block_size,
                                       args.tokenizer, image_limits_from_args(args), args.tokenizer_workers))
