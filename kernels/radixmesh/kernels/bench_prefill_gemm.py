"""A prefill's projections through cuBLAS at every row count: where does the GEMM rate dip? JSON lines.

    python -m radixmesh.kernels.bench_prefill_gemm --shape llama-3.1-8b --rows 1024:4160:64

A prefill of M tokens runs each layer's stacked q/k/v, o, stacked gate/up and down projections as one
`[M, K] @ [K, N]` GEMM each, through `nn.Linear` (cuBLAS picks the kernel by shape). For each M this
times the four, one CUDA graph per call, as:

- `linear`: `F.linear(x, W)` with `W` `[N, K]`, as the model runs them;
- `pad128` / `pad256`: the same on M rounded up to a multiple of 128 / 256 rows (the padding's own copy not
  counted: it tells whether a rounded M would run faster, not what padding costs);
- `nn`: `x @ Wt` with the weight stored transposed, `[K, N]` (another cuBLAS layout);
- `lt`: `F.linear` with PyTorch's preferred BLAS library set to cuBLASLt;
- `tuned`: `F.linear` under PyTorch's TunableOp, which times the GEMM solutions it has for each shape on first use
  and keeps the fastest (not in the default list: tuning takes a while per shape).

Each line is one M: milliseconds per layer for each variant and its rate in TFLOP/s (counted on the real M).
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F

from radixmesh.kernels._bench import run_info, time_us
from radixmesh.kernels.bench_gemv import SHAPES

VARIANTS = ("linear", "pad128", "pad256", "nn", "lt", "tuned")
DEFAULT_VARIANTS = ("linear", "pad128", "pad256", "nn", "lt")


def parse_rows(spec: str) -> list[int]:
    """`start:stop:step` (stop excluded) or a comma list."""
    if ":" in spec:
        start, stop, step = (int(part) for part in spec.split(":"))
        return list(range(start, stop, step))
    return [int(part) for part in spec.split(",")]


def round_up(rows: int, multiple: int) -> int:
    return -(-rows // multiple) * multiple


def layer_us(rows: int, weights: list[tuple[str, torch.Tensor, torch.Tensor]], variant: str,
             inputs: dict[int, torch.Tensor]) -> dict[str, float | None]:
    """Microseconds of each projection of one layer on `rows` tokens under `variant`."""
    padded = {"pad128": round_up(rows, 128), "pad256": round_up(rows, 256)}.get(variant, rows)
    out: dict[str, float | None] = {}
    library = torch.backends.cuda.preferred_blas_library()
    tunable = torch.cuda.tunable.is_enabled()
    try:
        if variant == "lt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        if variant == "tuned":
            torch.cuda.tunable.enable(True)
            torch.cuda.tunable.tuning_enable(True)
        for name, weight, weight_t in weights:
            x = inputs[weight.shape[1]][:padded]
            call = (functools.partial(torch.mm, x, weight_t) if variant == "nn"
                    else functools.partial(F.linear, x, weight))
            out[name] = time_us([call])
    finally:
        torch.backends.cuda.preferred_blas_library(library)
        torch.cuda.tunable.enable(tunable)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1024:4160:64", help="M values: start:stop:step or a comma list")
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    parser.add_argument("--tuning-ms", type=int, default=30, help="TunableOp's time per shape (`tuned`)")
    parser.add_argument("--result-file", default=None, help="also append the lines here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_prefill_gemm needs a CUDA device")
    rows_list = parse_rows(args.rows)
    if "tuned" in args.variants:
        torch.cuda.tunable.set_filename("/tmp/radixmesh-prefill-gemm-tunableop.csv")
        torch.cuda.tunable.set_max_tuning_duration(args.tuning_ms)
    torch.manual_seed(0)
    weights = []
    for name, n, k in SHAPES[args.shape]:
        if name == "lm_head":  # a prefill projects its last rows only
            continue
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        weights.append((name, weight, weight.t().contiguous()))
    most = round_up(max(rows_list), 256)
    inputs = {k: torch.randn(most, k, device="cuda", dtype=torch.bfloat16)
              for k in {w.shape[1] for _, w, _ in weights}}
    info = {"bench": "prefill-gemm", "shape": args.shape, **run_info("radixmesh.kernels.bench_prefill_gemm")}
    for rows in rows_list:
        flop = sum(2 * rows * w.shape[0] * w.shape[1] for _, w, _ in weights)
        line: dict[str, object] = {**info, "rows": rows}
        for variant in args.variants:
            each = layer_us(rows, weights, variant, inputs)
            total = None if any(v is None for v in each.values()) else sum(v for v in each.values() if v)
            line[f"{variant}_us"] = each
            line[f"{variant}_layer_us"] = None if total is None else round(total, 1)
            line[f"{variant}_tflops"] = None if not total else round(flop / total / 1e6, 1)
        print(json.dumps(line), flush=True)
        if args.result_file:
            with open(args.result_file, "a") as f:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
