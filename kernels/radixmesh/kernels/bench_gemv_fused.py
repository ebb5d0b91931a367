"""The batch-1 GEMVs of a decode step as the engine launches them, per layer shape: default tiles vs a sweep.

    python -m radixmesh.kernels.bench_gemv_fused [--sets llama-3.1-8b llama-3.1-8b-tp2] [--sweep]

Kinds: `plain` (`gemv` / `gemv_fp8`: o and down), `gated` (`gemv_add_rmsnorm(gated=True)`: norm + gate/up +
SiLU-and-mul) and `rope` (`gemv_add_rmsnorm_rope`: norm + q/k/v + rotary + KV store), in bf16 and with FP8
weights. As `bench_gemv`: weights copied past the L2 cache, one CUDA graph calling each copy in turn
(with PDL on, as in a step, so each call overlaps the tail of the one before), median replay / calls.
JSON lines with the default tiles' time and, with `--sweep`, the best configuration (candidates for
`gemv.TUNED_FUSED`).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable

import torch

from radixmesh.kernels.bench_gemv import L2_SPAN_BYTES, time_per_call_ms
from radixmesh.kernels.fp8_quant import quantize_rows
from radixmesh.kernels.gemv import GemvConfig, fused_config, gemv, gemv_fp8
from radixmesh.kernels.gemv_fused import gemv_add_rmsnorm
from radixmesh.kernels.gemv_rope import RopeStore, gemv_add_rmsnorm_rope, rope_block_n

# (layer, kind, N, K, (q heads, kv heads, head_dim) for rope)
SETS: dict[str, list[tuple[str, str, int, int, tuple[int, int, int] | None]]] = {
    "llama-3.1-8b": [("qkv", "rope", 6144, 4096, (32, 8, 128)), ("o", "plain", 4096, 4096, None),
                     ("gate_up", "gated", 28672, 4096, None), ("down", "plain", 4096, 14336, None)],
    "llama-3.1-8b-tp2": [("qkv", "rope", 3072, 4096, (16, 4, 128)), ("o", "plain", 4096, 2048, None),
                         ("gate_up", "gated", 14336, 4096, None), ("down", "plain", 4096, 7168, None),
                         ("lm_head", "plain", 64128, 4096, None)],
}
Weights = list[tuple[torch.Tensor, torch.Tensor | None]]
"""(weight, FP8 row scales or None) per copy."""
DEVICE = torch.device("cuda")
SWEEP = [GemvConfig(bn, bk, warps, stages) for bn in (4, 8, 16) for bk in (256, 512, 1024)
         for warps in (2, 4, 8) for stages in (3, 4) if 1024 <= bn * bk <= 16384]


@functools.lru_cache(maxsize=1)  # one layer's inputs at a time, shared by its sweep
def _inputs(kind: str, n: int, k: int, fp8: bool, heads: tuple[int, int, int] | None
            ) -> tuple[Weights, torch.Tensor, torch.Tensor, torch.Tensor, RopeStore | None]:
    dev, act = DEVICE, torch.bfloat16
    copies = max(2, math.ceil(L2_SPAN_BYTES / (n * k * (1 if fp8 else 2))))
    gen = torch.Generator(device=dev).manual_seed(n + k)
    weights: Weights = []
    for _ in range(copies):
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(act)
        weights.append(quantize_rows(w) if fp8 else (w, None))
    x, r = torch.randn(1, k, device=dev, dtype=act), torch.randn(1, k, device=dev, dtype=act)
    nw = torch.ones(k, device=dev, dtype=act)
    rope = None
    if heads is not None:
        hq, hkv, d = heads
        cos = torch.randn(64, d // 2, device=dev)
        pool = torch.zeros(16, hkv, d, device=dev, dtype=act)
        one = torch.tensor([3], device=dev)
        rope = RopeStore(one, cos, cos.clone(), pool, pool.clone(), one, hq, hkv, d)
    return weights, x, r, nw, rope


def _calls(kind: str, n: int, k: int, fp8: bool, heads: tuple[int, int, int] | None,
           cfg: GemvConfig | None) -> list[Callable[[], object]]:
    weights, x, r, nw, rope = _inputs(kind, n, k, fp8, heads)
    if kind == "plain":
        return [functools.partial(gemv_fp8, x, w, s, config=cfg) if s is not None
                else functools.partial(gemv, x, w, config=cfg) for w, s in weights]
    if kind == "gated":
        return [functools.partial(gemv_add_rmsnorm, x, r, nw, 1e-5, w, s, gated=True, config=cfg)
                for w, s in weights]
    assert rope is not None, "the rope kind needs (q heads, kv heads, head_dim)"
    return [functools.partial(gemv_add_rmsnorm_rope, x, r, nw, 1e-5, w, s, rope, config=cfg)
            for w, s in weights]


def bench(label: str, layer: str, kind: str, n: int, k: int, heads: tuple[int, int, int] | None, fp8: bool,
          sweep: bool) -> dict[str, object]:
    nbytes = n * k * (1 if fp8 else 2)
    default = fused_config(kind, n, k, fp8)
    ms = time_per_call_ms(_calls(kind, n, k, fp8, heads, None))
    row: dict[str, object] = {"bench": "gemv-fused", "set": label, "layer": layer, "kind": kind, "n": n, "k": k,
                              "weights": "fp8" if fp8 else "bf16", "gpu": torch.cuda.get_device_name(),
                              "default_config": vars(default), "default_us": round(ms * 1000, 2),
                              "default_tb_s": round(nbytes / ms / 1e9, 3)}
    if sweep:
        timed = []
        for cfg in SWEEP:
            if kind == "rope" and heads is not None and rope_block_n(cfg, heads[2]) is None:
                continue
            try:
                timed.append((time_per_call_ms(_calls(kind, n, k, fp8, heads, cfg)), cfg))
            except Exception as exc:  # a tile this GPU cannot hold (shared memory): skipped, reported
                print(f"# {label} {layer} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
        best_ms, best = min(timed, key=lambda pair: pair[0])
        row |= {"best_config": vars(best), "best_us": round(best_ms * 1000, 2),
                "best_tb_s": round(nbytes / best_ms / 1e9, 3)}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", nargs="+", choices=sorted(SETS), default=sorted(SETS))
    p.add_argument("--weights", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    p.add_argument("--sweep", action="store_true", help="also time a grid of tile configurations")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemv_fused needs a CUDA device", file=sys.stderr)
        return 2
    for label in args.sets:
        for weights in args.weights:
            if label.endswith("tp2") and weights == "fp8":
                continue  # TP is measured in bf16
            for layer, kind, n, k, heads in SETS[label]:
                print(json.dumps(bench(label, layer, kind, n, k, heads, weights == "fp8", args.sweep)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
