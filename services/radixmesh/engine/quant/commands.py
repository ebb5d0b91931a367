"""`radixmesh bench fp8-accuracy` and `radixmesh bench kv-capacity` (registered without importing torch)."""

from __future__ import annotations

import argparse


def _common(parser: argparse.ArgumentParser) -> None:
    from radixmesh.engine.args import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--model-shape", default=None, help="named shape for random weights (with --load-format dummy)")
    parser.add_argument("--result-file", default=None, help="append the JSON result to this file")


def register_fp8_accuracy(bench: argparse._SubParsersAction) -> None:
    parser = bench.add_parser("fp8-accuracy", help="FP8 weights/KV vs the unquantized model: logits of N prompts")
    _common(parser)
    parser.set_defaults(quantization="fp8", max_total_tokens=16384)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--min-len", type=int, default=4, help="shortest random prompt (tokens)")
    parser.add_argument("--max-len", type=int, default=64, help="longest random prompt (tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=lambda args: _run("accuracy", "cmd_fp8_accuracy", args))


def register_kv_capacity(bench: argparse._SubParsersAction) -> None:
    parser = bench.add_parser("kv-capacity", help="KV tokens that fit, per weight quantization and KV dtype")
    _common(parser)
    parser.set_defaults(load_format="dummy")
    parser.add_argument("--variants", nargs="+", default=["none/auto", "none/fp8_e4m3", "fp8/auto", "fp8/fp8_e4m3"],
                        help="QUANTIZATION/KV_CACHE_DTYPE pairs to build (none: unquantized weights)")
    parser.set_defaults(func=lambda args: _run("capacity", "cmd_kv_capacity", args))


def _run(module: str, func: str, args: argparse.Namespace) -> int:
    import importlib

    code: int = getattr(importlib.import_module(f"radixmesh.engine.quant.{module}"), func)(args)
    return code
