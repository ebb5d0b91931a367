"""`radixmesh bench kv-capacity`: how many KV tokens fit next to the weights, for each pair of weight
quantization and KV dtype, sized exactly as serving sizes the pool (`--mem-fraction-static`)."""

from __future__ import annotations

import argparse
import gc
import json
import sys
from typing import Any

import torch


def build_variant(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    from radixmesh.engine.args import engine_kwargs
    from radixmesh.engine.config import EngineConfig
    from radixmesh.engine.loader import prepare_model
    from radixmesh.engine.model_runner import ModelRunner

    quantization, _, kv_dtype = variant.partition("/")
    kwargs = engine_kwargs(args)
    kwargs.update(model=args.model_shape or args.model, disable_cuda_graph=True, fp8_gemm_backend="triton",
                  quantization=None if quantization in ("", "none") else quantization,
                  kv_cache_dtype=kv_dtype or "auto")
    config = EngineConfig(**kwargs).resolve()
    runner = ModelRunner(config, prepare_model(config.model, config.load_format, lend_tokenizer=False))
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    info = runner.memory_info()
    result = {"variant": variant, "max_total_tokens": runner.plan.max_total_tokens,
              "kv_bytes_per_token": info["kv_bytes_per_token"], "kv_cache_dtype": info["kv_cache_dtype"],
              "weight_gib": round(weight_bytes / 2**30, 3),
              "kv_pool_gib": round(runner.plan.max_total_tokens * int(str(info["kv_bytes_per_token"])) / 2**30, 3)}
    del runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def cmd_kv_capacity(args: argparse.Namespace) -> int:
    rows = [build_variant(args, variant) for variant in args.variants]
    for row in rows:
        print(f"{row['variant']:<18} {row['max_total_tokens']:>10,} KV tokens  ({row['kv_bytes_per_token']:,} B/token, "
              f"KV {row['kv_pool_gib']} GiB, weights {row['weight_gib']} GiB)")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"bench": "kv-capacity", "model": args.model_shape or args.model, "device": device,
              "load_format": args.load_format,
              "mem_fraction_static": args.mem_fraction_static, "variants": rows, "command": " ".join(sys.argv)}
    line = json.dumps(result)
    print(line)
    if args.result_file:
        with open(args.result_file, "a") as fh:
            fh.write(line + "\n")
    return 0


