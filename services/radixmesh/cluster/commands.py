"""`radixmesh cluster up|down|status`. Imports nothing heavy at module level: the CLI must start fast."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixmesh.cluster.spec import ClusterSpec


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `cluster` subcommand to the `radixmesh` command."""
    from radixmesh.engine.args import add_model_args

    cmd = sub.add_parser("cluster", help="start or stop a local cluster (Redis, workers, tokenizer, router, gateway)",
                         description="A development cluster on 127.0.0.1: every service in its own background "
                                     "process on a free port, stopped together by `radixmesh cluster down`.")
    actions = cmd.add_subparsers(dest="action", required=True)
    up = actions.add_parser("up", help="start a cluster and print the gateway URL")
    up.add_argument("--workers", type=int, default=None,
                    help="number of unified workers (default: 2, or 0 with --decode-workers)")
    up.add_argument("--prefill-workers", type=int, default=0,
                    help="disaggregation: prefill workers (compute prompts, send their KV to decode workers)")
    up.add_argument("--decode-workers", type=int, default=0,
                    help="disaggregation: decode workers (the router names a prefill worker for each prompt)")
    up.add_argument("--routers", type=int, default=1,
                    help="router replicas on their own ports, all sharing the Redis index; the gateway is given "
                         "every one of them (--router a,b). 0: no router service, the gateway routes in its own "
                         "process (gateway --embedded-router, with --policy and --router-args): one hop less")
    up.add_argument("--redis", default=None,
                    help="URL of an existing Redis (default: start one when redis-server is installed)")
    up.add_argument("--policy", default="cache-aware",
                    choices=("cache-aware", "approx-tree", "power-of-two", "round-robin", "random"),
                    help="routing policy of the routers")
    add_model_args(up)
    up.add_argument("--gpus", default="auto", metavar="auto|none|IDS",
                    help="GPUs of the workers: auto (when they run on CUDA: this host's GPUs, or those "
                         "CUDA_VISIBLE_DEVICES names, round robin; a worker with --tp-size N takes N in a row), "
                         "none (leave CUDA_VISIBLE_DEVICES as it is) or a list such as 0,1. Each worker sees every "
                         "selected GPU, its own first, as the cuda-ipc KV transport needs")
    up.add_argument("--port", type=int, default=0, help="gateway HTTP port (0 picks a free one)")
    services = up.add_argument_group("per-service flags", "extra flags handed to one kind of service, shell-quoted; "
                                     "the model flags above already go to every service that loads the model or "
                                     "its tokenizer (workers, tokenizer, grammar)")
    services.add_argument("--worker-args", default="",
                          help="for every worker, e.g. '--max-total-tokens 8192'; an MoE model over 2 GPUs per worker "
                               "with its experts spread: '--tp-size 2 --ep-size 2'")
    services.add_argument("--router-args", default="", help="for every router, e.g. '--health-interval-s 0.5'")
    services.add_argument("--tokenizer-args", default="", help="for the tokenizer service, e.g. '--block-size 32'")
    services.add_argument("--grammar-args", default="",
                          help="for the grammar service (with --grammar), e.g. '--compile-threads 4'")
    services.add_argument("--gateway-args", default="", help="for the gateway, e.g. '--max-queued-requests 64'")
    up.add_argument("--log-level", default="warning", help="logging level of every service")
    up.add_argument("--timeout-s", type=float, default=600.0, help="how long to wait for the services to answer")
    up.add_argument("--grammar", action="store_true",
                    help="start the grammar service too (workers fetch structured-output grammars from it)")
    up.add_argument("--metrics", action="store_true",
                    help="serve every service's Prometheus metrics on a free port (printed, and in the state file)")
    up.add_argument("--otlp-endpoint", default=None,
                    help="send every service's OpenTelemetry traces to this OTLP/gRPC endpoint (host:port); "
                         "default: $OTEL_EXPORTER_OTLP_ENDPOINT as each service reads it, else off")
    up.add_argument("--tls-dir", type=Path, default=None,
                    help="a directory with ca.crt, tls.crt and tls.key (a cert-manager Secret's files; tls.crt for "
                         "127.0.0.1 or --tls-server-name): mutual TLS between every service, TLS on the gateway")
    up.add_argument("--tls-server-name", default=None,
                    help="with --tls-dir: the name the services' certificate carries, when not 127.0.0.1")
    _state_dir_arg(up)
    up.set_defaults(func=cmd_up)
    down = actions.add_parser("down", help="stop the cluster started by `cluster up`")
    _state_dir_arg(down)
    down.set_defaults(func=cmd_down)
    status = actions.add_parser("status", help="print the running cluster's addresses and which processes live")
    _state_dir_arg(status)
    status.set_defaults(func=cmd_status)


def _state_dir_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where the state file and logs live (default: <cache dir>/cluster)")


def _state_dir(args: argparse.Namespace) -> Path:
    from radixmesh.cluster.local import default_state_dir

    return args.state_dir or default_state_dir()


def cmd_up(args: argparse.Namespace) -> int:
    from radixmesh.cluster.local import ClusterSpec, cluster_up, resolve_gpus
    from radixmesh.engine.args import model_kwargs

    num_workers = args.workers if args.workers is not None else (0 if args.decode_workers else 2)
    spec = ClusterSpec(num_workers=num_workers, num_prefill_workers=args.prefill_workers,
                       num_decode_workers=args.decode_workers, num_routers=args.routers, redis_url=args.redis,
                       policy=args.policy, **model_kwargs(args), gateway_port=args.port, worker_args=args.worker_args,
                       router_args=args.router_args, tokenizer_args=args.tokenizer_args,
                       grammar_args=args.grammar_args, gateway_args=args.gateway_args, log_level=args.log_level,
                       state_dir=_state_dir(args), timeout_s=args.timeout_s, otlp_endpoint=args.otlp_endpoint,
                       metrics=args.metrics, grammar=args.grammar, tls_dir=args.tls_dir,
                       tls_server_name=args.tls_server_name, gpus=args.gpus)
    spec = resolve_gpus(spec)
    _print_gpus(spec)
    state = cluster_up(spec)
    roles = [role for _, role in spec.worker_roles()]
    tiers = ", ".join(f"{roles.count(r)} {r}" for r in ("unified", "prefill", "decode") if r in roles)
    routers = ",".join(state.router_addresses) or "in the gateway's process"
    print(f"radixmesh cluster: workers {tiers}, router {routers} "
          f"({state.policy}), tokenizer {state.tokenizer_address}, Redis {state.redis_url or 'none'}"
          + (f", grammar {state.grammar_address}" if state.grammar_address else ""))
    if state.model_args:
        print(f"radixmesh cluster: model flags {' '.join(state.model_args)}")
    for name, url in state.metrics_urls.items():
        print(f"radixmesh cluster: {name} metrics at {url}")
    if args.otlp_endpoint:
        print(f"radixmesh cluster: traces go to {args.otlp_endpoint}")
    if args.tls_dir:
        print(f"radixmesh cluster: mutual TLS between the services, TLS on the gateway ({args.tls_dir})")
    print(f"radixmesh cluster: logs in {state.log_dir}; stop with `radixmesh cluster down`")
    print(state.gateway_url, flush=True)
    return 0


def _print_gpus(spec: ClusterSpec) -> None:
    """One line per worker placed on GPUs (none when the environment is left alone), a warning when they share."""
    placement = spec.worker_gpus()
    num_own = spec.worker_tp_size()
    for name, visible in placement.items():
        own = ",".join(visible[:num_own])
        print(f"radixmesh cluster: {name} on GPU {own} (CUDA_VISIBLE_DEVICES={','.join(visible)})")
    num_needed, num_gpus = num_own * len(placement), len(spec.gpu_ids())
    if num_needed > num_gpus:
        print(f"radixmesh cluster: warning: {len(placement)} workers need {num_needed} GPUs, {num_gpus} selected: "
              "they share GPUs round robin", file=sys.stderr)
    sys.stdout.flush()


def cmd_down(args: argparse.Namespace) -> int:
    from radixmesh.cluster.local import cluster_down

    stopped = cluster_down(_state_dir(args))
    print(f"radixmesh cluster: stopped {', '.join(stopped)}" if stopped else "radixmesh cluster: nothing running")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from radixmesh.cluster.local import cluster_status

    state, alive = cluster_status(_state_dir(args))
    if state is None:
        print("radixmesh cluster: none")
        return 1
    routers = ",".join(state.router_addresses or [state.router_address]) or "in the gateway"
    print(f"gateway {state.gateway_url}  router {routers}  redis {state.redis_url or 'none'}")
    for name, pid in state.pids.items():
        gpus = f"  GPUs {state.worker_gpus[name]}" if name in state.worker_gpus else ""
        print(f"  {name:<10} pid {pid:<8} {'running' if alive[name] else 'stopped'}{gpus}")
    return 0 if all(alive.values()) else 1
