"""`radixmesh worker`. Imports nothing heavy at module level: the CLI must start fast."""

from __future__ import annotations

import argparse

DEFAULT_PORT = 50051


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `worker` subcommand to the `radixmesh` command."""
    from radixmesh.common.grpc_server import add_server_args
    from radixmesh.engine.args import add_engine_args
    from radixmesh.engine.disagg.transport.registry import KV_TRANSPORT_CHOICES

    cmd = sub.add_parser("worker", help="serve one engine over gRPC (WorkerService)",
                         description="Run the engine's scheduler in its own process behind the gRPC "
                                     "WorkerService: Generate streams token ids, plus Abort, GetLoad, "
                                     "FlushCache, GetModelInfo, and Prefill on prefill workers.")
    cmd.add_argument("--role", default="unified", choices=("unified", "prefill", "decode"),
                     help="unified serves whole requests; prefill/decode are disaggregation tiers (a decode "
                          "worker has the prefill worker a router names compute the prompt and send its KV)")
    cmd.add_argument("--kv-transport", default="auto", choices=KV_TRANSPORT_CHOICES,
                     help="disaggregation: how KV moves from prefill to decode workers (grpc: bytes over the "
                          "Prefill call, anywhere; cuda-ipc: GPU to GPU on one host; nixl: READ over NIXL/UCX, across "
                          "nodes, needs radixmesh[nixl]; auto: cuda-ipc between workers on one host seeing each "
                          "other's GPUs, else nixl when installed, else grpc, per pair of workers)")
    cmd.add_argument("--kv-lease-s", type=float, default=60.0,
                     help="disaggregation: seconds a KV reservation (decode) or exported KV (prefill) is held at most")
    cmd.add_argument("--prefill-timeout-s", type=float, default=30.0,
                     help="decode: seconds to wait for the prefill worker's KV and first token before computing "
                          "the prompt here (below --kv-lease-s)")
    cmd.add_argument("--peer-fetch", default="auto", choices=("auto", "always", "off"),
                     help="prefix sharing: fetch the KV of a prompt prefix that a router says another worker holds "
                          "(auto: when the measured transfer rate beats this worker's measured prefill rate)")
    cmd.add_argument("--peer-fetch-timeout-s", type=float, default=10.0,
                     help="prefix sharing: seconds a fetch may take before the prompt is computed here instead")
    cmd.add_argument("--peer-fetch-min-tokens", type=int, default=32,
                     help="prefix sharing: fetch only when the peer holds at least this many more prompt tokens")
    cmd.add_argument("--worker-id", default="", help="id in the KV-cache index and routing (default: host:port)")
    cmd.add_argument("--advertise-address", default="",
                     help="host:port others dial (default: the listening host:port)")
    cmd.add_argument("--block-size", type=int, default=16, help="tokens per block of the published KV-cache events")
    cmd.add_argument("--http-port", type=int, default=None,
                     help="also serve the OpenAI-compatible HTTP API over this worker's engine on this port (0 picks "
                          "a free one; reported in GetLoad): an inference gateway's proxy sends requests here after "
                          "the router's endpoint picker (--epp-port) chose this worker (unified workers; default: off)")
    cmd.add_argument("--served-model-name", default=None,
                     help="with --http-port: the name clients pass as 'model' (default: the model's own name)")
    add_server_args(cmd, DEFAULT_PORT, log_level=False, lane=True)
    add_engine_args(cmd)
    cmd.set_defaults(func=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    from radixmesh.common.aio import run_main
    from radixmesh.common.grpc_server import server_config, setup_logging
    from radixmesh.engine.args import engine_kwargs
    from radixmesh.engine.config import EngineConfig
    from radixmesh.worker.config import WorkerConfig
    from radixmesh.worker.server import serve_worker

    setup_logging(args.log_level, "worker")
    config = WorkerConfig(role=args.role, worker_id=args.worker_id, advertise_address=args.advertise_address,
                          block_size=args.block_size, redis_url=args.redis_url, kv_transport=args.kv_transport,
                          kv_lease_s=args.kv_lease_s, prefill_timeout_s=args.prefill_timeout_s,
                          peer_fetch=args.peer_fetch, peer_fetch_timeout_s=args.peer_fetch_timeout_s,
                          peer_fetch_min_tokens=args.peer_fetch_min_tokens, http_port=args.http_port,
                          served_model_name=args.served_model_name)
    return run_main(serve_worker(server_config(args), config, EngineConfig(**engine_kwargs(args))))
