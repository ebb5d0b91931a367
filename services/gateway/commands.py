"""`radixmesh serve`. Imports nothing heavy at module level: the CLI must start fast."""

from __future__ import annotations

import argparse

from radixmesh.common.env import env_str


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand to the `radixmesh` command."""
    from radixmesh.cli import add_engine_args

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible and native HTTP API",
                           description="Serve a model over HTTP: OpenAI API under /v1, SGLang-native "
                                       "/generate, /health, /metrics. With no flags: the default model, "
                                       "on CUDA when available, else CPU, at http://127.0.0.1:8000.")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 for all)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (0 picks a free one)")
    serve.add_argument("--api-key", default=env_str("API_KEY"),
                       help="require 'Authorization: Bearer <key>' (default: $RADIXMESH_API_KEY; none: open)")
    serve.add_argument("--served-model-name", default=None,
                       help="name clients pass as 'model' (default: the model's own name)")
    serve.add_argument("--max-queued-requests", type=int, default=None,
                       help="sequences that may wait beyond the engine's running slots; more get HTTP 429 "
                            "(default: unlimited)")
    serve.add_argument("--max-default-tokens", type=int, default=4096,
                       help="output cap for chat and /generate requests that give no max tokens")
    serve.add_argument("--graceful-shutdown-s", type=float, default=5.0,
                       help="on SIGINT/SIGTERM, seconds open requests may finish before they are aborted")
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from radixmesh.cli import engine_kwargs
    from radixmesh.engine.config import EngineConfig
    from radixmesh.gateway.config import GatewayConfig
    from radixmesh.gateway.server import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = GatewayConfig(host=args.host, port=args.port, api_key=args.api_key,
                           served_model_name=args.served_model_name, max_queued_requests=args.max_queued_requests,
                           max_default_tokens=args.max_default_tokens, graceful_shutdown_s=args.graceful_shutdown_s,
                           log_level=args.log_level)
    return asyncio.run(serve(config, EngineConfig(**engine_kwargs(args))))
