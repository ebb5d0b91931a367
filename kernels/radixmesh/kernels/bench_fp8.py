"""FP8 linear layers at real shapes: per (layer, M), bf16 cuBLAS against the FP8 paths; JSON lines.

    python -m radixmesh.kernels.bench_fp8 [--shapes llama-3.1-8b] [--ms 1 8 64 512 4096] [--gemv-sweep]

For every M: `torch.matmul` in bf16, `torch._scaled_mm` (row-wise scales) and the Triton FP8 GEMM on the
same quantized operands, and the per-token activation quantization on its own; at M = 1 also the GEMV
kernel in bf16 and with FP8 weights. Weights are copied until a graph of calls exceeds the L2 cache (as
`bench_gemv`), so small-M figures are memory-bound as in a decode step. `fp8_best` names the faster FP8
GEMM, the choice the engine makes when it measures at load (`--fp8-gemm-backend auto`). `--gemv-sweep`
times a grid of FP8 GEMV configurations per layer (candidates for `gemv.TUNED_FP8`).
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
from radixmesh.kernels.fp8_gemm import fp8_gemm
from radixmesh.kernels.fp8_quant import quantize_rows
from radixmesh.kernels.gemv import GemvConfig, default_config_fp8, gemv, gemv_fp8

DEFAULT_MS = [1, 2, 8, 32, 64, 128, 256, 512, 1024, 4096, 8192]
FP8_SWEEP = [GemvConfig(bn, bk, warps, stages) for bn in (4, 8, 16, 32) for bk in (256, 512, 1024)
             for warps in (2, 4, 8) for stages in (3, 4, 6) if 2048 <= bn * bk <= 16384]


def _scaled_mm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch._scaled_mm(xq, w.t(), scale_a=xs.view(-1, 1), scale_b=ws.view(1, -1),
                                         out_dtype=torch.bfloat16)
    return out


def _try_ms(calls: list[Callable[[], object]]) -> float | None:
    try:
        return time_per_call_ms(calls)
    except Exception as exc:  # a path this GPU or torch build lacks: reported, not fatal
        print(f"# skipped: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
        return None


def bench_layer(shape: str, name: str, n: int, k: int, ms: list[int], gemv_sweep: bool) -> list[dict[str, object]]:
    copies = max(2, math.ceil(L2_SPAN_BYTES / (n * k)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    fp8 = [quantize_rows(w) for w in weights]  # per output channel (the kernel is row-wise either way)
    rows = []
    for m in ms:
        row: dict[str, object] = {"bench": "fp8-linear", "shape": shape, "layer": name, "n": n, "k": k, "m": m,
                                  "gpu": torch.cuda.get_device_name()}
        row.update(bench_m(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), weights, fp8, gemv_sweep))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def bench_m(x: torch.Tensor, weights: list[torch.Tensor], fp8: list[tuple[torch.Tensor, torch.Tensor]],
            gemv_sweep: bool) -> dict[str, object]:
    """Timings of one M (`x` `[M, K]` bf16) over the weight copies: bf16 and both FP8 GEMMs, at M = 1 the GEMVs."""
    xq, xs = quantize_rows(x)
    ref = (xq.float() @ fp8[0][0].float().t()) * xs[:, None] * fp8[0][1][None, :]
    row: dict[str, object] = {
        "bf16_us": _us(_try_ms([functools.partial(torch.matmul, x, w.t()) for w in weights])),
        "quant_us": _us(_try_ms([functools.partial(quantize_rows, x)]))}
    for key, fn in (("scaled_mm", _scaled_mm), ("triton", fp8_gemm)):
        row[f"{key}_us"] = _us(_try_ms([functools.partial(fn, xq, xs, w, s) for w, s in fp8]))
        row[f"{key}_rel_err"] = _rel_err(fn, xq, xs, fp8[0], ref)
    timed = {key: float(row[f"{key}_us"]) for key in ("scaled_mm", "triton") if row[f"{key}_us"] is not None}  # type: ignore[arg-type]
    row["fp8_best"] = min(timed, key=timed.__getitem__) if timed else None
    if x.shape[0] != 1:
        return row
    n, k = fp8[0][0].shape
    fp8_us = _us(_try_ms([functools.partial(gemv_fp8, x, w, s) for w, s in fp8]))
    row.update(gemv_bf16_us=_us(_try_ms([functools.partial(gemv, x, w) for w in weights])), gemv_fp8_us=fp8_us,
               gemv_fp8_config=vars(default_config_fp8(n, k)),
               gemv_fp8_tb_s=round(n * k / (fp8_us * 1e-6) / 1e12, 3) if fp8_us else None)
    if gemv_sweep:
        timed_cfg = [(t, cfg) for cfg in FP8_SWEEP
                     if (t := _try_ms([functools.partial(gemv_fp8, x, w, s, config=cfg) for w, s in fp8]))]
        best_ms, best = min(timed_cfg, key=lambda pair: pair[0])
        row.update(gemv_fp8_best_config=vars(best), gemv_fp8_best_us=_us(best_ms))
    return row


def _us(ms: float | None) -> float | None:
    return None if ms is None else round(ms * 1000, 2)


def _rel_err(fn: Callable[..., torch.Tensor], xq: torch.Tensor, xs: torch.Tensor, wq: tuple[torch.Tensor, torch.Tensor],
             ref: torch.Tensor) -> float | None:
    try:
        got = fn(xq, xs, *wq).float()
    except Exception:
        return None
    return round(float((got - ref).norm() / ref.norm()), 5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["llama-3.1-8b"])
    p.add_argument("--ms", nargs="+", type=int, default=DEFAULT_MS, help="rows (tokens) per GEMM")
    p.add_argument("--gemv-sweep", action="store_true", help="also time a grid of FP8 GEMV configurations at M = 1")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8 needs a CUDA device", file=sys.stderr)
        return 2
    for shape in args.shapes:
        for name, n, k in SHAPES[shape]:
            if name != "lm_head":  # the LM head stays in bf16 under --quantization fp8
                bench_layer(shape, name, n, k, args.ms, args.gemv_sweep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
