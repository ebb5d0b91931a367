"""`radixmesh bench ...`: benchmark subcommands, each registered from its own module.

Modules named here must import nothing heavy at module level: the CLI builds the parsers on start.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from radixmesh.common.registry import LazyRegistry

BENCH_COMMANDS: LazyRegistry[Callable[[argparse._SubParsersAction], None]] = LazyRegistry("bench command", {
    # a serving endpoint (serve, gateway) under a generated workload
    "serving": "loadtests.serving:register",
    "goodput": "loadtests.goodput:register",
    "grpc-vs-http": "loadtests.api_overhead:register",
    "paired": "loadtests.paired:register",
    "tool-calls": "loadtests.tool_calls:register",
    "front-end": "loadtests.front_end:register",
    "front-end-load": "loadtests.front_end_load:register",
    # the engine in-process
    "one-batch": "radixmesh.engine.bench.throughput:register_one_batch",
    "offline": "radixmesh.engine.bench.throughput:register_offline",
    "structured": "radixmesh.engine.bench.structured:register_structured",
    "fp8-accuracy": "radixmesh.engine.quant.commands:register_fp8_accuracy",
    "kv-capacity": "radixmesh.engine.quant.commands:register_kv_capacity",
    "images": "radixmesh.engine.bench.images:register_images",
    "hicache": "radixmesh.engine.bench.hicache:register_hicache",
    "speculative": "radixmesh.engine.bench.speculative:register_speculative",
    "kv-transfer": "radixmesh.engine.disagg.bench_transfer:register_kv_transfer",
    "lora": "radixmesh.engine.bench.lora:register_lora",
    # a local cluster of services
    "routing": "radixmesh.cluster.bench:register_routing",
    "epp": "radixmesh.cluster.bench_epp:register_epp",
    "peer-fetch": "radixmesh.cluster.bench_peer_fetch:register_peer_fetch",
    "faults": "radixmesh.cluster.bench_faults:register_faults",
    "soak": "radixmesh.cluster.soak:register_soak",
    "lora-routing": "radixmesh.cluster.bench_lora:register_lora_routing",
})
"""`radixmesh bench` subcommand -> "module:function" adding it to the `bench` subparsers object."""

GROUPS = {
    "serving endpoint": ("serving", "goodput", "grpc-vs-http", "paired", "tool-calls", "front-end",
                         "front-end-load"),
    "engine (in-process)": ("one-batch", "offline", "structured", "fp8-accuracy", "kv-capacity", "images",
                            "hicache", "speculative", "kv-transfer", "lora"),
    "local cluster": ("routing", "epp", "peer-fetch", "faults", "soak", "lora-routing"),
}
"""How `radixmesh bench --help` lists the subcommands."""

MODULE_BENCHMARKS = {
    "radixmesh.kernels.bench_decode": "split-KV decode attention kernel",
    "radixmesh.kernels.bench_extend": "extend (prefill) attention kernel",
    "radixmesh.kernels.bench_fp8": "FP8 linear layers against bf16 cuBLAS",
    "radixmesh.kernels.bench_gemv": "batch-1 GEMV kernel against cuBLAS",
    "radixmesh.kernels.bench_gemv_fused": "a decode step's fused GEMVs, default tiles vs a sweep",
    "radixmesh.kernels.bench_lora": "batched LoRA next to the base GEMMs",
    "radixmesh.kernels.bench_moe": "the fused MoE layer at real shapes",
    "radixmesh.kernels.bench_moe_sweep": "tile sweep of the MoE layer for one shape",
    "radixmesh.kernels.bench_moe_block": "Qwen3-30B-A3B's MoE block of one token: one launch against four",
    "radixmesh.engine.distributed.bench_allreduce": "all-reduce at decode sizes across the GPUs of one host",
}
"""Micro-benchmarks run as `python -m MODULE` (GPU only; each prints JSON)."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench` to the `radixmesh` command."""
    bench = sub.add_parser("bench", help="benchmarks: serving endpoints, the engine, local clusters",
                           description="Benchmarks; each prints its device, its command and a machine-readable "
                                       "result.", epilog=bench_listing(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_commands(bench)


def bench_listing() -> str:
    """What `radixmesh bench` has, by group, and the micro-benchmarks beside it."""
    lines = [f"{group}: {', '.join(names)}" for group, names in GROUPS.items()]
    lines.append("micro-benchmarks (python -m MODULE --help):")
    lines += [f"  {module}  {what}" for module, what in MODULE_BENCHMARKS.items()]
    return "\n".join(lines)


def add_bench_commands(parser: argparse.ArgumentParser) -> None:
    bench_sub = parser.add_subparsers(dest="bench_command", required=True)
    for name in BENCH_COMMANDS:
        BENCH_COMMANDS.load(name)(bench_sub)
