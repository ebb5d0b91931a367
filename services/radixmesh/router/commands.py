"""`radixmesh router`. Imports nothing heavy at module level: the CLI must start fast."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixmesh.router.config import RouterConfig
    from radixmesh.router.discovery.base import BaseDiscovery
    from radixmesh.router.epp.config import EppConfig

DEFAULT_PORT = 50053
POLICIES = ("cache-aware", "approx-tree", "power-of-two", "round-robin", "random")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `router` subcommand to the `radixmesh` command."""
    from radixmesh.common.grpc_server import add_server_args

    cmd = sub.add_parser("router", help="route Generate calls to workers (RouterService)",
                         description="Pick a worker per request by the KV-cache index and load, health-check "
                                     "workers, retry before the first token, and stream the answer back.")
    add_routing_args(cmd)
    add_epp_args(cmd)
    add_server_args(cmd, DEFAULT_PORT, lane=True)
    cmd.set_defaults(func=cmd_router)


def add_epp_args(cmd: argparse.ArgumentParser) -> None:
    """The router as an inference pool's endpoint picker (Gateway API Inference Extension, ext_proc)."""
    group = cmd.add_argument_group("endpoint picker", "serve Envoy's ext_proc as the Gateway API Inference "
                                   "Extension's endpoint picker: a proxy asks which worker's HTTP API "
                                   "(worker --http-port) serves each request (docs/kubernetes.md)")
    group.add_argument("--epp-port", type=int, default=None,
                       help="port of the endpoint picker (envoy.service.ext_proc.v3.ExternalProcessor and "
                            "grpc.health.v1; 0 picks a free one; default: no picker)")
    group.add_argument("--tokenizer", default=None,
                       help="endpoint picker: host:port of the tokenizer service, which turns prompts into token "
                            "ids and block hashes for the cache lookup (without it, text prompts are picked by load)")
    group.add_argument("--epp-tokenize", default="local", choices=("local", "service"),
                       help="endpoint picker: tokenize prompts with a copy of the tokenizer service's tokenizer in "
                            "this process (local: no round trip per request) or with a Tokenize call each (service)")
    group.add_argument("--epp-fallbacks", type=int, default=0,
                       help="endpoint picker: endpoints after the pick in the destination header and metadata, for "
                            "proxies that retry down the list (0: the pick alone, as an ORIGINAL_DST cluster "
                            "reading the header needs)")
    group.add_argument("--epp-max-queue", type=int, default=0,
                       help="endpoint picker: answer 429 when every worker has this many requests waiting (0: never "
                            "shed)")


def add_routing_args(cmd: argparse.ArgumentParser) -> None:
    """How a router finds workers and picks one (shared by `radixmesh router` and `gateway --embedded-router`)."""
    from radixmesh.common.lane import GENERATE_TRANSPORTS, TRANSPORT_HELP

    cmd.add_argument("--lora-paths", nargs="*", default=[],
                     help="LoRA adapters the router may load onto workers, NAME=PATH (a path on the workers): a "
                          "request of an adapter no worker holds (or a hot one) gets it loaded on the least loaded")
    cmd.add_argument("--policy", default="cache-aware", choices=POLICIES,
                     help="routing policy (cache-aware needs --redis-url, else it runs as approx-tree)")
    cmd.add_argument("--workers", default="", help="static worker list host:port,... (implies --discovery static)")
    cmd.add_argument("--discovery", default=None, choices=("static", "redis", "kubernetes"),
                     help="where workers come from (default: static with --workers, else redis)")
    cmd.add_argument("--selector", default="app.kubernetes.io/component=worker",
                     help="kubernetes discovery: label selector of the worker pods")
    cmd.add_argument("--namespace", default=None, help="kubernetes discovery: namespace (default: the router's)")
    cmd.add_argument("--block-size", type=int, default=16, help="tokens per block of the prompts' hashes")
    cmd.add_argument("--index-namespace", default="radixmesh", help="key prefix of the KV-cache index in Redis")
    cmd.add_argument("--index-lookup", default="inline", choices=("inline", "async"),
                     help="cache-aware: wait for a request's index lookup inline (a blocking loopback round trip "
                          "that does not queue behind the streams being relayed; at most 0.1 s while Redis hangs) "
                          "or awaited")
    cmd.add_argument("--generate-transport", default="lane", choices=GENERATE_TRANSPORTS, help=TRANSPORT_HELP)
    cmd.add_argument("--health-interval-s", type=float, default=1.0, help="seconds between health probes")
    cmd.add_argument("--health-failure-threshold", type=int, default=2,
                     help="failed probes in a row that mark a worker unhealthy")
    cmd.add_argument("--health-success-threshold", type=int, default=1,
                     help="passed probes in a row that mark a worker healthy again")
    cmd.add_argument("--redis-probe-s", type=float, default=1.0,
                     help="while Redis is down (routing falls back to approx-tree), seconds between checks for it")
    cmd.add_argument("--max-attempts", type=int, default=3, help="tries per request before its first token")
    cmd.add_argument("--wait-for-worker-s", type=float, default=5.0,
                     help="a request that finds no healthy worker waits this long for one before failing (0: at once)")
    cmd.add_argument("--migration", default="on", choices=("on", "off"),
                     help="a stream whose worker dies, drains or fails after its first token continues on another "
                          "worker from the tokens already sent (off: it ends with the error)")
    cmd.add_argument("--max-migrations", type=int, default=3, help="most migrations of one request")
    cmd.add_argument("--seed", type=int, default=None, help="seed of the random and power-of-two policies")
    cmd.add_argument("--pd-min-prefill-tokens", type=int, default=256,
                     help="disaggregation: prompts with fewer tokens uncached on the chosen decode worker skip the "
                          "prefill workers (0: every prompt goes through a prefill worker)")
    cmd.add_argument("--peer-fetch-min-tokens", type=int, default=512,
                     help="cache-aware: name a peer worker holding at least this many more prompt tokens on its "
                          "device than the chosen worker, which may then fetch their KV (0: never)")
    cmd.add_argument("--host-hit-weight", type=float, default=0.5,
                     help="cache-aware: a prompt token in a worker's host tier counts this much of one on its device")


def embedded_router_flags(flags: str) -> tuple[RouterConfig, BaseDiscovery]:
    """The config and discovery of `radixmesh gateway --embedded-router FLAGS`: `radixmesh router`'s routing
    flags and --redis-url, as one shell-quoted string (a bad flag exits with the router's usage)."""
    import shlex

    from radixmesh.common.env import env_str

    parser = argparse.ArgumentParser(prog="radixmesh gateway --embedded-router",
                                     description="Routing flags of `radixmesh router`, in the gateway's process.")
    add_routing_args(parser)
    parser.add_argument("--redis-url", default=env_str("REDIS_URL"),
                        help="Redis of the KV-cache index and worker leases (default: $RADIXMESH_REDIS_URL; none: off)")
    args = parser.parse_args(shlex.split(flags))
    return router_config(args), make_discovery(args)


def cmd_router(args: argparse.Namespace) -> int:
    from radixmesh.common.aio import run_main
    from radixmesh.common.grpc_server import server_config, setup_logging

    setup_logging(args.log_level, "router")
    config = router_config(args)
    discovery = make_discovery(args)
    from radixmesh.router.server import serve_router

    return run_main(serve_router(server_config(args), config, discovery, epp_config(args)))


def epp_config(args: argparse.Namespace) -> EppConfig | None:
    """The endpoint picker's config, when --epp-port is given."""
    if args.epp_port is None:
        return None
    from radixmesh.router.epp.config import EppConfig

    return EppConfig(port=args.epp_port, tokenizer=args.tokenizer, fallbacks=args.epp_fallbacks,
                     max_queue_per_worker=args.epp_max_queue, tokenize=args.epp_tokenize)


def router_config(args: argparse.Namespace) -> RouterConfig:
    from radixmesh.router.config import (
        AdapterConfig,
        DisaggConfig,
        HealthConfig,
        MigrationConfig,
        RetryConfig,
        RouterConfig,
        ScoringConfig,
    )
    from radixmesh.wire.lora import parse_lora_path

    return RouterConfig(policy=args.policy, block_size=args.block_size, redis_url=args.redis_url,
                        index_namespace=args.index_namespace, index_lookup=args.index_lookup, seed=args.seed,
                        generate_transport=args.generate_transport,
                        redis_probe_s=args.redis_probe_s,
                        health=HealthConfig(interval_s=args.health_interval_s,
                                            failure_threshold=args.health_failure_threshold,
                                            success_threshold=args.health_success_threshold),
                        retry=RetryConfig(max_attempts=args.max_attempts, wait_for_worker_s=args.wait_for_worker_s),
                        migration=MigrationConfig(enabled=args.migration == "on",
                                                  max_per_request=args.max_migrations),
                        disagg=DisaggConfig(min_prefill_tokens=args.pd_min_prefill_tokens),
                        scoring=ScoringConfig(host_hit_weight=args.host_hit_weight),
                        peer_fetch_min_tokens=args.peer_fetch_min_tokens,
                        adapters=AdapterConfig(tuple(parse_lora_path(item) for item in args.lora_paths)))


def make_discovery(args: argparse.Namespace) -> BaseDiscovery:
    from radixmesh.common.errors import invalid_argument

    kind = args.discovery or ("static" if args.workers else "redis")
    if kind == "static":
        from radixmesh.router.discovery.static import StaticDiscovery, parse_workers

        return StaticDiscovery(parse_workers(args.workers))
    if args.workers:
        raise invalid_argument(f"--workers is for static discovery, not {kind}", "workers")
    if kind == "redis":
        if not args.redis_url:
            raise invalid_argument("redis discovery needs --redis-url (or give --workers)", "redis_url")
        from radixmesh.index.config import IndexConfig
        from radixmesh.index.reader import KVIndexReader
        from radixmesh.index.writer import connect
        from radixmesh.router.discovery.redis_leases import RedisLeaseDiscovery

        index = IndexConfig(redis_url=args.redis_url, namespace=args.index_namespace, block_size=args.block_size)
        return RedisLeaseDiscovery(KVIndexReader(index, connect(index)))
    from radixmesh.router.discovery.kubernetes import make_kubernetes_discovery

    return make_kubernetes_discovery(args.selector, args.namespace)
