"""`radixmesh serve` and `radixmesh gateway`. Imports nothing heavy at module level: the CLI must start fast."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from radixmesh.common.env import env_str
from radixmesh.common.tls import add_tls_args
from radixmesh.common.tracing import add_tracing_args
from radixmesh.engine.tokenize_pool import DEFAULT_TOKENIZER_WORKERS
from radixmesh.gateway.config import DETOKENIZE_MODES, TOKENIZE_MODES

if TYPE_CHECKING:
    from radixmesh.gateway.config import GatewayConfig


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand to the `radixmesh` command."""
    from radixmesh.engine.args import add_engine_args
    from radixmesh.engine.mm.config import add_image_args

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible and native HTTP API",
                           description="Serve a model over HTTP: OpenAI API under /v1, SGLang-native "
                                       "/generate, /health, /metrics. With no flags: the default model, "
                                       "on CUDA when available, else CPU, at http://127.0.0.1:8000.")
    _add_http_args(serve)
    serve.add_argument("--tokenizer-workers", type=int, default=DEFAULT_TOKENIZER_WORKERS,
                       help="threads that tokenize prompts off the event loop; prompts that arrive while all are "
                            "busy are encoded together, a long prompt in pieces on several (default: %(default)s)")
    add_engine_args(serve)
    add_image_args(serve)
    serve.set_defaults(func=cmd_serve)
    _register_gateway(sub)


def _add_http_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (0 picks a free one)")
    parser.add_argument("--grpc-port", type=int, default=None,
                        help="also serve the public gRPC API (radixmesh.v1.InferenceService, health, reflection) on "
                             "this port (0 picks a free one; default: no gRPC API)")
    parser.add_argument("--api-key", default=env_str("API_KEY"),
                        help="require 'Authorization: Bearer <key>' on HTTP and gRPC (default: $RADIXMESH_API_KEY; "
                             "none: open). Prefer --api-key-file: a flag shows in the process list")
    parser.add_argument("--api-key-file", default=env_str("API_KEY_FILE"),
                        help="accepted keys, one per line, or a directory of such files (a mounted Kubernetes "
                             "Secret); read again when it changes (default: $RADIXMESH_API_KEY_FILE)")
    parser.add_argument("--served-model-name", default=None,
                        help="name clients pass as 'model' (default: the model's own name)")
    parser.add_argument("--max-queued-requests", type=int, default=None,
                        help="sequences that may wait beyond the engine's running slots; more get HTTP 429 "
                             "(default: unlimited)")
    parser.add_argument("--max-default-tokens", type=int, default=4096,
                        help="output cap for chat and /generate requests that give no max tokens")
    parser.add_argument("--graceful-shutdown-s", type=float, default=5.0,
                        help="on SIGINT/SIGTERM, seconds open requests may finish before they are aborted")
    _add_tool_args(parser)
    add_tracing_args(parser)
    add_tls_args(parser, public=True)


def _add_tool_args(parser: argparse.ArgumentParser) -> None:
    from radixmesh.gateway.reasoning import REASONING_PARSERS
    from radixmesh.gateway.tools.registry import TOOL_PARSERS

    group = parser.add_argument_group("tools and reasoning (docs/tools.md)")
    group.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                       help="how the model writes tool calls (default: from its chat template or name, else hermes)")
    group.add_argument("--strict-tools", action="store_true",
                       help="constrain tool_choice 'auto' as well: once the model starts a call, its name is one of "
                            "the tools and its arguments follow the tool's JSON Schema (required and named choices "
                            "are always constrained)")
    group.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                       help="return a thinking model's <think> part as reasoning_content, apart from content "
                            "(default: none)")


def _gateway_config(args: argparse.Namespace) -> GatewayConfig:
    """The gateway's config; also sets how this process dials other services (mutual TLS with --tls-ca)."""
    from radixmesh.common.tls import configure_clients, tls_config_from_args
    from radixmesh.engine.mm.config import image_limits_from_args
    from radixmesh.gateway.config import GatewayConfig

    tls = tls_config_from_args(args)
    configure_clients(tls)
    return GatewayConfig(host=args.host, port=args.port, api_key=args.api_key, api_key_file=args.api_key_file,
                         grpc_port=args.grpc_port, tls=tls,
                         served_model_name=args.served_model_name, max_queued_requests=args.max_queued_requests,
                         max_default_tokens=args.max_default_tokens, graceful_shutdown_s=args.graceful_shutdown_s,
                         log_level=args.log_level, image_limits=image_limits_from_args(args),
                         tool_call_parser=args.tool_call_parser, strict_tools=args.strict_tools,
                         reasoning_parser=args.reasoning_parser,
                         tokenizer_workers=getattr(args, "tokenizer_workers", DEFAULT_TOKENIZER_WORKERS))


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from radixmesh.common import tracing
    from radixmesh.common.aio import run_main
    from radixmesh.engine.args import engine_kwargs
    from radixmesh.engine.config import EngineConfig
    from radixmesh.gateway.server import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tracing.configure("serve", args.otlp_endpoint)
    return run_main(serve(_gateway_config(args), EngineConfig(**engine_kwargs(args))))


def _register_gateway(sub: argparse._SubParsersAction) -> None:
    from radixmesh.common.lane import GENERATE_TRANSPORTS, TRANSPORT_HELP

    gateway = sub.add_parser("gateway", help="serve the HTTP API over the cluster's gRPC services",
                             description="The same OpenAI-compatible and native HTTP API as `radixmesh serve`, "
                                         "over a tokenizer service and a router (or one worker). It serves at "
                                         "once: /live is 200 while the process runs, /health and /ready are 503 "
                                         "naming the missing dependency until the router and tokenizer answer.")
    target = gateway.add_mutually_exclusive_group(required=True)
    target.add_argument("--router", help="host:port of the router service; several replicas as host:port,host:port "
                                         "(requests go to the ready ones in turn, failing over before streaming)")
    target.add_argument("--worker", help="host:port of one worker, for a cluster without a router")
    target.add_argument("--embedded-router", metavar="ROUTER_FLAGS",
                        help="route in this process instead of through a router service, with `radixmesh "
                             "router`'s routing flags as one quoted string, e.g. \"--workers h1:p1,h2:p2 --redis-url "
                             "redis://redis:6379\" (discovery, policy, health checks and retries as the router's); "
                             "the gateway then calls the chosen worker itself: one gRPC hop less each way")
    gateway.add_argument("--tokenizer", required=True, help="host:port of the tokenizer service")
    gateway.add_argument("--detokenize", choices=DETOKENIZE_MODES, default="local",
                         help="where output tokens become text: 'local' copies the tokenizer service's tokenizer "
                              "into the gateway once (fingerprint-checked) and saves a round trip per streamed "
                              "message; 'service' sends every message through the service's Detokenize stream "
                              "(default: %(default)s; local falls back to service if the copy fails)")
    gateway.add_argument("--tokenize", choices=TOKENIZE_MODES, default="local",
                         help="where text and chat prompts become token ids and block hashes: 'local' encodes them "
                              "in the gateway with the same copy of the service's tokenizer (a thread pool of "
                              "--tokenizer-workers; saves the Tokenize round trip before each prompt's first token); "
                              "'service' calls the tokenizer service for each prompt (default: %(default)s; prompts "
                              "with images, and all prompts while the copy is not loaded, go to the service)")
    gateway.add_argument("--tokenizer-workers", type=int, default=DEFAULT_TOKENIZER_WORKERS,
                         help="threads of the gateway's own tokenizer pool with --tokenize local (default: "
                              "%(default)s)")
    gateway.add_argument("--generate-transport", default="lane", choices=GENERATE_TRANSPORTS,
                         help=TRANSPORT_HELP + " (with --embedded-router, its own flag of that name sets the "
                                               "transport to the workers)")
    _add_http_args(gateway)
    gateway.add_argument("--log-level", default="warning", help="logging level")
    gateway.set_defaults(func=cmd_gateway)


def cmd_gateway(args: argparse.Namespace) -> int:
    import logging

    from radixmesh.common import tracing
    from radixmesh.common.aio import run_main
    from radixmesh.gateway.cluster_backend import ClusterBackend
    from radixmesh.gateway.server import serve_backend

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tracing.configure("gateway", args.otlp_endpoint)  # before the backend's channels are built
    config = _gateway_config(args)
    if args.embedded_router is not None:
        from radixmesh.gateway.embedded_router import start_embedded

        return run_main(serve_backend(
            config, lambda: start_embedded(args.tokenizer, args.embedded_router, config.served_model_name,
                                           args.detokenize, args.tokenize, config.tokenizer_workers),
            f"routing in this process ({args.embedded_router}); the tokenizer at {args.tokenizer}"))
    kind, address = ("router", args.router) if args.router else ("worker", args.worker)
    return run_main(serve_backend(
        config, lambda: ClusterBackend.start(args.tokenizer, address, kind, config.served_model_name,
                                          detokenize=args.detokenize, transport=args.generate_transport,
                                          tokenize=args.tokenize, tokenizer_workers=config.tokenizer_workers),
        f"connecting to the {kind} at {address} and the tokenizer at {args.tokenizer}"))
