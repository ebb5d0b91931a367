"""Decode-batch linear layers: the skinny GEMM kernel against cuBLAS (and cuBLASLt) at real shapes; JSON lines.

    python -m radixmesh.kernels.bench_skinny_gemm --shape llama-3.1-8b --rows 32 64 128 168 256 [--sweep]

Timing as in bench_gemv: enough weight copies to exceed L2, one CUDA graph calling the layer once per copy, the
median replay divided by the calls; bandwidth counts the weight bytes (what a decode step must read).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable

import torch

from radixmesh.kernels.bench_gemv import L2_SPAN_BYTES, SHAPES, time_per_call_ms
from radixmesh.kernels.skinny_gemm import SHARED_BYTES, SkinnyConfig, default_config, skinny_gemm


def sweep_configs(m: int) -> list[SkinnyConfig]:
    top = max(16, min(256, 1 << (m - 1).bit_length()))
    out = []
    for bm in (16, 32, 64, 128, 256):
        if bm > top or (bm * 4 < top and bm < 64):
            continue
        for bn in (32, 64, 128, 256):
            for bk in (64, 128):
                if bm * bn > 32768 or bm * bn * bk > 4 << 20:
                    continue
                for stages in (3, 5):
                    if stages * (bm + bn) * bk * 2 > SHARED_BYTES:
                        continue
                    out.append(SkinnyConfig(bm, bn, bk, 4 if bm * bn <= 8192 else 8, stages))
    return out


def bench_layer(shape: str, name: str, n: int, k: int, m: int, sweep: bool) -> dict[str, object]:
    dtype = torch.bfloat16
    copies = max(2, math.ceil(L2_SPAN_BYTES / (n * k * dtype.itemsize)))
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    outs = [torch.empty(m, n, device="cuda", dtype=dtype) for _ in range(copies)]
    want = torch.nn.functional.linear(x.float(), weights[0].float())
    err = float((skinny_gemm(x, weights[0]).float() - want).norm() / want.norm())
    assert err < 2e-2, f"{shape} {name} M={m}: relative error {err:.3g} against float32"

    def calls(fn: Callable[[torch.Tensor, torch.Tensor], object]) -> list[Callable[[], object]]:
        return [functools.partial(fn, w, o) for w, o in zip(weights, outs)]

    def ours(cfg: SkinnyConfig | None) -> float:
        return time_per_call_ms(calls(lambda w, o: skinny_gemm(x, w, o, cfg)))

    def library(name: str) -> float:
        torch.backends.cuda.preferred_blas_library(name)
        try:
            return time_per_call_ms(calls(lambda w, o: torch.matmul(x, w.t(), out=o)))
        finally:
            torch.backends.cuda.preferred_blas_library("cublas")

    nbytes = n * k * dtype.itemsize

    def fig(ms: float) -> dict[str, float]:
        return {"us": round(ms * 1000, 2), "tb_s": round(nbytes / ms / 1e9, 3)}

    result: dict[str, object] = {
        "bench": "skinny-gemm", "shape": shape, "layer": name, "m": m, "n": n, "k": k, "dtype": "bfloat16",
        "gpu": torch.cuda.get_device_name(), "rel_err": round(err, 5),
        "cublas": fig(library("cublas")), "cublaslt": fig(library("cublaslt")),
        "default_config": vars(default_config(m, n, k)), "default": fig(ours(None)),
    }
    if sweep:
        timed = sorted(((ours(cfg), cfg) for cfg in sweep_configs(m)), key=lambda pair: pair[0])
        result |= {"best_config": vars(timed[0][1]), "best": fig(timed[0][0]),
                   "top3": [[vars(cfg), round(ms * 1000, 2)] for ms, cfg in timed[:3]]}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--layers", nargs="+", help="only these layers (qkv o gate_up down lm_head)")
    p.add_argument("--rows", nargs="+", type=int, default=[32, 64, 128, 168, 256])
    p.add_argument("--sweep", action="store_true", help="also time a grid of tile configurations")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_skinny_gemm needs a CUDA device", file=sys.stderr)
        return 2
    for name, n, k in SHAPES[args.shape]:
        if args.layers and name not in args.layers:
            continue
        for m in args.rows:
            print(json.dumps(bench_layer(args.shape, name, n, k, m, args.sweep)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
