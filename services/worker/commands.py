"""`radixmesh worker`. Imports nothing heavy at module level: the CLI must start fast."""

from __future__ import annotations

import argparse

DEFAULT_PORT = 50051


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `worker` subcommand to the `radixmesh` command."""
    from radixmesh.cli import add_engine_args
    from radixmesh.common.grpc_server import add_server_args

    cmd = sub.add_parser("worker", help="serve one engine over gRPC (WorkerService)",
                         description="Run the engine's scheduler in its own process behind the gRPC "
                                     "WorkerService: Generate streams token ids, plus Abort, GetLoad, "
                                     "FlushCache, GetModelInfo.")
    cmd.add_argument("--role", default="unified", choices=("unified", "prefill", "decode"),
                     help="unified serves whole requests; prefill/decode are disaggregation tiers "
                          "(their transfer RPCs are not implemented yet)")
    cmd.add_argument("--worker-id", default="", help="id in the KV-cache index and routing (default: host:port)")
    cmd.add_argument("--advertise-address", default="",
                     help="host:port others dial (default: the listening host:port)")
    cmd.add_argument("--block-size", type=int, default=16, help="tokens per block of the published KV-cache events")
    add_server_args(cmd, DEFAULT_PORT, log_level=False)
    add_engine_args(cmd)
    cmd.set_defaults(func=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    import asyncio

    from radixmesh.cli import engine_kwargs
    from radixmesh.common.grpc_server import server_config, setup_logging
    from radixmesh.engine.config import EngineConfig
    from radixmesh.worker.config import WorkerConfig
    from radixmesh.worker.server import serve_worker

    setup_logging(args.log_level, "worker")
    config = WorkerConfig(role=args.role, worker_id=args.worker_id, advertise_address=args.advertise_address,
                          block_size=args.block_size, redis_url=args.redis_url)
    return asyncio.run(serve_worker(server_config(args), config, EngineConfig(**engine_kwargs(args))))
