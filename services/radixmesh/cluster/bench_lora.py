"""`radixmesh bench lora-routing`: where requests of LoRA adapters land on a local cluster, against random routing.

Starts a cluster (Redis, tokenizer, router, gateway and `--workers` workers serving adapters; or uses the running
one of `--cluster-state DIR`), writes `--adapters` random PEFT adapters of the model (rank `--rank`; or takes
`--lora-paths NAME=PATH ...`), loads adapter i on worker i mod N through the gateway, then sends `--requests`
requests of the adapters in random order through the router and reads where each one ran. Reports the hit rate (the
request ran on a worker holding its adapter, by the workers' own lists) against random routing over the same
requests, and ends with one JSON line (`--result-file` appends it). Adapters it placed on a running cluster are
unloaded at the end.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

LORA_WORKER_ARGS = "--enable-lora --max-loras-per-batch 2 --max-lora-rank {rank} --max-total-tokens 4096"


def register_lora_routing(sub: argparse._SubParsersAction) -> None:
    """Add `lora-routing` to `radixmesh bench`."""
    from radixmesh.engine.args import add_model_args

    cmd = sub.add_parser("lora-routing", help="LoRA adapter affinity on a local cluster: hit rate vs random routing",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(cmd)
    cmd.add_argument("--workers", type=int, default=2, help="workers of the cluster it starts")
    cmd.add_argument("--adapters", type=int, default=4, help="random adapters to write and place")
    cmd.add_argument("--rank", type=int, default=8, help="rank of the random adapters")
    cmd.add_argument("--lora-paths", nargs="*", default=[], help="NAME=PATH adapters to place instead of random ones")
    cmd.add_argument("--requests", type=int, default=16, help="requests, adapters in random order")
    cmd.add_argument("--prompt-len", type=int, default=8, help="random prompt tokens per request")
    cmd.add_argument("--max-new-tokens", type=int, default=2, help="tokens generated per request")
    cmd.add_argument("--worker-args", default=None,
                     help=f"flags of the workers it starts (default: {LORA_WORKER_ARGS.format(rank='RANK')})")
    cmd.add_argument("--cluster-state", type=Path, default=None,
                     help="use the running cluster of this state directory (`radixmesh cluster up --state-dir`, "
                          "workers started with --enable-lora; --model as theirs) instead of starting one")
    cmd.add_argument("--seed", type=int, default=0)
    cmd.add_argument("--result-file", default=None, help="append the JSON result to this file")
    cmd.set_defaults(func=cmd_lora_routing)


def cmd_lora_routing(args: argparse.Namespace) -> int:
    from radixmesh.cluster.local import cluster_down, cluster_up
    from radixmesh.cluster.spec import ClusterSpec, ClusterState

    work = Path(tempfile.mkdtemp(prefix="radixmesh-bench-lora-routing-"))
    worker_args = args.worker_args or LORA_WORKER_ARGS.format(rank=args.rank)
    spec = ClusterSpec(num_workers=args.workers, model=args.model, load_format=args.load_format,
                       tokenizer=args.tokenizer, dtype=args.dtype, context_length=args.context_length,
                       worker_args=worker_args, state_dir=work / "cluster")
    adapters = _adapters(args, work / "adapters")
    if args.cluster_state is not None:
        state = ClusterState.load(args.cluster_state)
        if state is None or not state.router_address:
            raise SystemExit(f"no cluster with a router service in {args.cluster_state}")
        result = _measure(args, state.gateway_url, state.router_address, adapters, unload=True)
    else:
        print(f"bench lora-routing: starting {args.workers} workers (logs in {work})", flush=True)
        state = cluster_up(spec)
        try:
            result = _measure(args, state.gateway_url, state.router_address, adapters, unload=False)
        finally:
            cluster_down(spec.state_dir, timeout_s=30)
    _report(args, result)
    return 0 if result["failed"] == 0 else 1


def _adapters(args: argparse.Namespace, root: Path) -> dict[str, str]:
    """name -> path: --lora-paths, or random adapters of the model written under `root`."""
    if args.lora_paths:
        from radixmesh.wire.lora import parse_lora_path

        return dict(parse_lora_path(item) for item in args.lora_paths)
    from radixmesh.engine.bench.lora import write_random_adapters
    from radixmesh.engine.loader.default_model import resolve_model_path
    from radixmesh.engine.model_config import ModelConfig

    config = ModelConfig.from_dir(resolve_model_path(args.model)[1])
    paths = write_random_adapters(config, root, args.adapters, args.rank, seed=args.seed)
    return {f"lora{i}": str(path) for i, path in enumerate(paths)}


def _measure(args: argparse.Namespace, gateway_url: str, router_address: str, adapters: dict[str, str],
             unload: bool) -> dict[str, Any]:
    from radixmesh.cluster.lora_affinity import measure, unload_adapters

    try:
        run = measure(gateway_url, router_address, adapters, args.requests, args.prompt_len, args.max_new_tokens,
                      args.seed)
    finally:
        if unload:
            unload_adapters(gateway_url, sorted(adapters))
    for error in run.errors[:5]:
        print(f"bench lora-routing: failed request: {error}", flush=True)
    return {"bench": "lora-routing", "device": _device(), "host": platform.node(), **run.summary(args.seed),
            "command": " ".join(["radixmesh", *sys.argv[1:]])}


def _device() -> str:
    """Where the workers of a cluster started here run (CUDA when this host has it)."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return "gpu" if torch.cuda.is_available() else "cpu"


def _report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    print(f"bench lora-routing: {result['requests']} requests of {result['adapters']} adapters over "
          f"{result['workers']} workers ({result['failed']} failed)")
    print(f"  adapter affinity  hit rate {result['hit_rate']:.3f}")
    print(f"  random routing    hit rate {result['random_hit_rate']:.3f} (expected {result['random_expected']:.3f})")
    print(f"  request p50 {result['request_ms_p50']} ms; placement {result['placement']}")
    for adapter, counts in result["landed"].items():
        print(f"  {adapter}: {counts}")
    line = json.dumps(result)
    print(line, flush=True)
    if args.result_file:
        with open(args.result_file, "a", encoding="utf-8") as f:
            f.write(line + "\n")
