"""`radixmesh bench ...`: benchmark subcommands, each registered from its own module.

Modules named here must import nothing heavy at module level: the CLI builds every parser
on start.
"""

from __future__ import annotations

import argparse
import importlib

BENCH_COMMANDS = [
    "loadtests.serving:register",
    "loadtests.goodput:register",
    "loadtests.api_overhead:register",
    "loadtests.paired:register",
    "radixmesh.engine.bench:register_one_batch",
    "radixmesh.engine.bench:register_offline",
    "radixmesh.engine.bench_structured:register_structured",
    "radixmesh.engine.quant.commands:register_fp8_accuracy",
    "radixmesh.engine.quant.commands:register_kv_capacity",
    "radixmesh.engine.bench_mm:register_images",
    "radixmesh.engine.bench_hicache:register_hicache",
    "radixmesh.engine.bench_spec:register_speculative",
    "radixmesh.engine.disagg.bench_transfer:register_kv_transfer",
    "radixmesh.cluster.bench:register_routing",
    "radixmesh.cluster.bench_epp:register_epp",
    "radixmesh.cluster.bench_peer_fetch:register_peer_fetch",
    "radixmesh.cluster.bench_faults:register_faults",
    "radixmesh.cluster.soak:register_soak",
]
"""`module:function` taking the `bench` subparsers object; one per `radixmesh bench` subcommand."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench` to the `radixmesh` command."""
    bench = sub.add_parser("bench", help="benchmarks: serving (online), one-batch and offline (engine)")
    add_bench_commands(bench)


def add_bench_commands(parser: argparse.ArgumentParser) -> None:
    bench_sub = parser.add_subparsers(dest="bench_command", required=True)
    for target in BENCH_COMMANDS:
        module, _, func = target.partition(":")
        getattr(importlib.import_module(module), func)(bench_sub)
