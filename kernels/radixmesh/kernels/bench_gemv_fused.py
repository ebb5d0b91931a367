"""The batch-1 GEMVs of a decode step as the engine launches them, per layer shape: default tiles vs a sweep.

    python -m radixmesh.kernels.bench_gemv_fused [--sets llama-3.1-8b qwen3-30b-a3b ...] [--sweep]

Kinds: `plain` (`gemv` / `gemv_fp8`: o, down, lm_head), `norm` (`gemv_add_rmsnorm`: the input norm + a
projection, Qwen3's q/k/v as a step launches it by default, before the rotary launch), `gated`
(`gemv_add_rmsnorm(gated=True)`: norm + gate/up + SiLU-and-mul), `rope` (`gemv_add_rmsnorm_rope`: norm + q/k/v +
rotary + KV store), `rope-norm` (the same with Qwen3's q/k norms: one head a program) and `router`
(`gemv_add_rmsnorm_out`: an MoE block's norm + router, bf16 only), in bf16 and with FP8 weights;
`rope-norm-split` and `router-split` time the launches the last two replace (`gemv_add_rmsnorm` then
`apply_rotary_` with the norms and the store; `rms_norm` then `gemv`), default tiles only.
As `bench_gemv`: weights copied past the L2 cache, one CUDA graph calling each copy in turn (with PDL on, as in
a step, so each call overlaps the tail of the one before), median replay / calls. JSON lines with the default
tiles' time and, with `--sweep`, the best configuration (candidates for `gemv.TUNED_FUSED`).
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
from radixmesh.kernels.fused import KVStoreTarget, QKNorm, apply_rotary_, rms_norm
from radixmesh.kernels.gemv import GemvConfig, fused_config, gemv, gemv_fp8
from radixmesh.kernels.gemv_fused import gemv_add_rmsnorm
from radixmesh.kernels.gemv_norm_out import gemv_add_rmsnorm_out
from radixmesh.kernels.gemv_rope import RopeStore, gemv_add_rmsnorm_rope, rope_block_n, rope_config

# (layer, kind, N, K, (q heads, kv heads, head_dim) for rope)
SETS: dict[str, list[tuple[str, str, int, int, tuple[int, int, int] | None]]] = {
    "llama-3.1-8b": [("qkv", "rope", 6144, 4096, (32, 8, 128)), ("o", "plain", 4096, 4096, None),
                     ("gate_up", "gated", 28672, 4096, None), ("down", "plain", 4096, 14336, None)],
    "llama-3.1-8b-tp2": [("qkv", "rope", 3072, 4096, (16, 4, 128)), ("o", "plain", 4096, 2048, None),
                         ("gate_up", "gated", 14336, 4096, None), ("down", "plain", 4096, 7168, None),
                         ("lm_head", "plain", 64128, 4096, None)],
    # Qwen3-30B-A3B's dense projections (the experts: bench_moe_small); its q/k/v and router fused and split
    "qwen3-30b-a3b": [("qkv", "rope-norm", 5120, 2048, (32, 4, 128)),
                      ("qkv", "rope-norm-split", 5120, 2048, (32, 4, 128)), ("qkv", "norm", 5120, 2048, None),
                      ("o", "plain", 2048, 4096, None),
                      ("router", "router", 128, 2048, None), ("router", "router-split", 128, 2048, None),
                      ("lm_head", "plain", 151936, 2048, None)],
    "qwen3-8b": [("qkv", "rope-norm", 6144, 4096, (32, 8, 128)), ("qkv", "rope-norm-split", 6144, 4096, (32, 8, 128)),
                 ("qkv", "norm", 6144, 4096, None),
                 ("o", "plain", 4096, 4096, None), ("gate_up", "gated", 24576, 4096, None),
                 ("down", "plain", 4096, 12288, None), ("lm_head", "plain", 151936, 4096, None)],
}
KINDS = ("plain", "norm", "gated", "rope", "rope-norm", "rope-norm-split", "router", "router-split")
SPLIT_KINDS = ("rope-norm-split", "router-split")
"""The launches a fused kind replaces, timed with their default tiles (no sweep)."""
BF16_KINDS = ("router", "router-split")
"""Kinds whose weights stay bf16 in an FP8 model (the router)."""
Weights = list[tuple[torch.Tensor, torch.Tensor | None]]
"""(weight, FP8 row scales or None) per copy."""
DEVICE = torch.device("cuda")
SWEEP = [GemvConfig(bn, bk, warps, stages) for bn in (4, 8, 16) for bk in (256, 512, 1024)
         for warps in (2, 4, 8) for stages in (3, 4) if 1024 <= bn * bk <= 16384]


def sweep_configs(kind: str, heads: tuple[int, int, int] | None) -> list[GemvConfig]:
    """The tiles a sweep tries: with q/k norms one head (head_dim rows) a program, in K tiles of 16..128."""
    if kind != "rope-norm":
        return SWEEP
    assert heads is not None, "the rope-norm kind needs (q heads, kv heads, head_dim)"
    return [GemvConfig(heads[2], bk, warps, stages) for bk in (16, 32, 64, 128) for warps in (4, 8, 16)
            for stages in (2, 3, 4) if heads[2] * bk <= 16384]


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
        norm = QKNorm(torch.ones(d, device=dev, dtype=act), torch.ones(d, device=dev, dtype=act), 1e-6)
        rope = RopeStore(one, cos, cos.clone(), pool, pool.clone(), one, hq, hkv, d,
                         qk_norm=norm if kind.startswith("rope-norm") else None)
    return weights, x, r, nw, rope


def _split_rope(x: torch.Tensor, r: torch.Tensor, nw: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None,
                rope: RopeStore) -> None:
    """The launches `rope-norm` replaces: the norm + q/k/v GEMV, then the q/k norms + rotary + KV store."""
    qkv, _ = gemv_add_rmsnorm(x, r, nw, 1e-5, w, s)
    hq, hkv, d = rope.num_q_heads, rope.num_kv_heads, rope.head_dim
    q, k, v = qkv.view(1, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
    apply_rotary_(q, k, rope.positions, rope.cos_cache, rope.sin_cache,
                  KVStoreTarget(v, rope.k_buffer, rope.v_buffer, rope.loc), rope.qk_norm)


def _split_router(x: torch.Tensor, r: torch.Tensor, nw: torch.Tensor, w: torch.Tensor) -> None:
    """The launches `router` replaces: the add + RMSNorm, then the router GEMV."""
    h, _ = rms_norm(x, nw, 1e-5, r)
    gemv(h, w)


def _calls(kind: str, n: int, k: int, fp8: bool, heads: tuple[int, int, int] | None,
           cfg: GemvConfig | None) -> list[Callable[[], object]]:
    weights, x, r, nw, rope = _inputs(kind, n, k, fp8, heads)
    if kind == "plain":
        return [functools.partial(gemv_fp8, x, w, s, config=cfg) if s is not None
                else functools.partial(gemv, x, w, config=cfg) for w, s in weights]
    if kind in ("norm", "gated"):
        return [functools.partial(gemv_add_rmsnorm, x, r, nw, 1e-5, w, s, gated=kind == "gated", config=cfg)
                for w, s in weights]
    if kind == "router":
        return [functools.partial(gemv_add_rmsnorm_out, x, r, nw, 1e-5, w, config=cfg) for w, _ in weights]
    if kind == "router-split":
        return [functools.partial(_split_router, x, r, nw, w) for w, _ in weights]
    assert rope is not None, "the rope kinds need (q heads, kv heads, head_dim)"
    if kind == "rope-norm-split":
        return [functools.partial(_split_rope, x, r, nw, w, s, rope) for w, s in weights]
    return [functools.partial(gemv_add_rmsnorm_rope, x, r, nw, 1e-5, w, s, rope, config=cfg)
            for w, s in weights]


def bench(label: str, layer: str, kind: str, n: int, k: int, heads: tuple[int, int, int] | None, fp8: bool,
          sweep: bool) -> dict[str, object]:
    nbytes = n * k * (1 if fp8 else 2)
    default = (None if kind in SPLIT_KINDS else rope_config(n, k, heads[2], fp8, True) if kind == "rope-norm"
               and heads is not None else fused_config(kind, n, k, fp8))
    ms = time_per_call_ms(_calls(kind, n, k, fp8, heads, None))
    row: dict[str, object] = {"bench": "gemv-fused", "set": label, "layer": layer, "kind": kind, "n": n, "k": k,
                              "weights": "fp8" if fp8 else "bf16", "gpu": torch.cuda.get_device_name(),
                              "default_config": vars(default) if default is not None else None,
                              "default_us": round(ms * 1000, 2), "default_tb_s": round(nbytes / ms / 1e9, 3)}
    if sweep and kind not in SPLIT_KINDS:
        timed = []
        for cfg in sweep_configs(kind, heads):
            if kind.startswith("rope") and heads is not None and \
                    rope_block_n(cfg, heads[2], kind == "rope-norm") is None:
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
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="only these kinds of layer")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemv_fused needs a CUDA device", file=sys.stderr)
        return 2
    for label in args.sets:
        for weights in args.weights:
            if label.endswith("tp2") and weights == "fp8":
                continue  # TP is measured in bf16
            for layer, kind, n, k, heads in SETS[label]:
                if kind not in args.kinds:
                    continue
                if weights == "fp8" and kind in BF16_KINDS:
                    continue  # the router is bf16 in an FP8 model: timed in the bf16 pass
                print(json.dumps(bench(label, layer, kind, n, k, heads, weights == "fp8", args.sweep)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
