"""Micro-benchmark of the split-KV decode kernel; prints one JSON object.

    python -m radixmesh.kernels.bench_decode --batch 64 --seq-len 2048 --heads 32 --kv-heads 8 \
        --head-dim 128 --dtype bf16

Every request has `--seq-len` tokens (or, with `--min-seq-len`, a length drawn uniformly from
that range, as in a decode batch of an offline run) whose KV slots are scattered over the pool
at random (page size 1, as after many requests came and went; `--slots contiguous` for the
best case). Time is the median of per-launch CUDA-event timings after warmup; bandwidth counts
the bytes of K and V read once.

`--sweep` times every combination of `--sweep-splits`, `--sweep-tiles` (SWEEP_TILES by default)
and both grid orders on the same inputs, one JSON line each:

    python -m radixmesh.kernels.bench_decode --batch 168 --min-seq-len 256 --seq-len 6144 --sweep

`--dtype fp8_e4m3` holds K/V in an FP8 pool (bf16 queries, scales as the engine's): `--sweep-widen` adds
the ways its tiles widen to dot operands (`decode_attention.FP8_WIDENS`), `--sweep-tiles fp8` the FP8 tile
set (SWEEP_TILES_FP8: more rows per tile, deeper pipelines: a 128-byte row is half a bf16 one). `--pick
FILE...` reads such sweeps (JSON lines) and prints the tiles and widening with the least total time over
their batches at the engine's own split counts, as the environment settings the engine reads:

    python -m radixmesh.kernels.bench_decode --pick fp8-sweep.jsonl
    RADIXMESH_DECODE_FP8_TILES=128,4,3 RADIXMESH_DECODE_FP8_WIDEN=f16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton

from radixmesh.kernels._checks import FP8_DTYPES
from radixmesh.kernels.decode_attention import (
    DEFAULT_MAX_KV_SPLITS,
    FP8_WIDENS,
    DecodeScratch,
    choose_num_kv_splits,
    decode_attention_fwd,
    get_num_sms,
)
from radixmesh.kernels.reference import attention_reference

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8_e4m3": torch.float8_e4m3fn}
# (BLOCK_N, num_warps, num_stages) tried by --sweep
SWEEP_TILES = ((64, 4, 2), (32, 4, 2), (32, 4, 3), (64, 4, 3), (64, 8, 2), (128, 8, 2), (16, 4, 4))
SWEEP_TILES_FP8 = ((64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3),
                   (256, 8, 2))
"""--sweep-tiles fp8: BLOCK_N 64 (the bf16 default) to 256 rows, 2-4 stages."""
FP8_K_SCALE, FP8_V_SCALE = 0.5, 2.0
"""The FP8 pool's scales (any: the kernel folds them into the softmax scale and the output)."""
PICK_MAX_ABS_ERR = 0.05
"""--pick skips rows whose --check error exceeds this (outputs are O(1): a wrong kernel, not rounding)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=2048, help="KV tokens per request (the longest, with --min-seq-len)")
    p.add_argument("--min-seq-len", type=int, default=0,
                   help="draw each request's length uniformly from [this, --seq-len] (seeded); 0: all --seq-len")
    p.add_argument("--slots", choices=("scattered", "contiguous"), default="scattered",
                   help="KV slots at random places in the pool, or each request's in one run")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--num-kv-splits", type=int, default=0, help="0: choose from length and SM count")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--cuda-graph", action="store_true", help="time replays of a captured graph (no launch cost)")
    p.add_argument("--check", action="store_true", help="compare the output with the PyTorch reference first")
    p.add_argument("--sweep", action="store_true", help="time the split counts, tiles and grid orders (one line each)")
    p.add_argument("--sweep-splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    p.add_argument("--sweep-tiles", nargs="+", default=[",".join(map(str, t)) for t in SWEEP_TILES],
                   help="BLOCK_N,num_warps,num_stages for each tile to sweep ('fp8': SWEEP_TILES_FP8)")
    p.add_argument("--sweep-widen", nargs="+", choices=FP8_WIDENS, default=["f32"],
                   help="FP8 pools: the widenings to sweep (default: f32, the kernel's default)")
    p.add_argument("--fp8-widen", choices=FP8_WIDENS, default="f32", help="FP8 pools: the widening of a single run")
    p.add_argument("--grid-orders", choices=("both", "head-major"), default="both",
                   help="--sweep: both grid orders, or the default head-major one alone")
    p.add_argument("--pick", nargs="+", metavar="JSONL", help="print the best FP8 tiles and widening of these "
                   "sweeps' lines (see above) and exit")
    args = p.parse_args(argv)
    if args.sweep_tiles == ["fp8"]:
        args.sweep_tiles = [",".join(map(str, t)) for t in SWEEP_TILES_FP8]
    try:
        args.sweep_tiles = [tuple(int(x) for x in t.split(",")) for t in args.sweep_tiles]
    except ValueError:
        p.error("--sweep-tiles takes BLOCK_N,num_warps,num_stages triples, e.g. 64,4,2")
    if any(len(t) != 3 for t in args.sweep_tiles):
        p.error("--sweep-tiles takes BLOCK_N,num_warps,num_stages triples, e.g. 64,4,2")
    for name in ("batch", "seq_len", "heads", "kv_heads", "head_dim", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.heads % args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    if args.min_seq_len > args.seq_len:
        p.error("--min-seq-len must be <= --seq-len")
    if min(args.sweep_splits) < 1:
        p.error("--sweep-splits must be >= 1")
    return args


def time_median_ms(fn: Callable[[], None], warmup: int, iters: int) -> list[float]:
    """Per-call times (ms) from CUDA events, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def time_graph_ms(fn: Callable[[], None], warmup: int, iters: int) -> list[float]:
    """Per-replay device times (ms) of `fn` captured in a CUDA graph: a short kernel timed by events around its
    own launch would include the host's launch time when that exceeds the kernel's."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_median_ms(graph.replay, warmup, iters)


def seq_lens_for(args: argparse.Namespace) -> list[int]:
    if not args.min_seq_len:
        return [args.seq_len] * args.batch
    gen = torch.Generator().manual_seed(1)
    return torch.randint(args.min_seq_len, args.seq_len + 1, (args.batch,), generator=gen).tolist()


def make_inputs(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The pool, slots and queries of one benchmark (FP8 pools hold `kv / scale`, queries stay bf16)."""
    dtype = DTYPES[args.dtype]
    is_fp8 = dtype == torch.float8_e4m3fn
    torch.manual_seed(0)
    seq_lens = seq_lens_for(args)
    num_slots = sum(seq_lens) + 1
    k_buf = torch.randn(num_slots, args.kv_heads, args.head_dim, dtype=torch.bfloat16 if is_fp8 else dtype,
                        device=device)
    v_buf = torch.randn_like(k_buf)
    k_scale, v_scale = (FP8_K_SCALE, FP8_V_SCALE) if is_fp8 else (1.0, 1.0)
    if is_fp8:
        k_buf, v_buf = (k_buf / k_scale).to(dtype), (v_buf / v_scale).to(dtype)
    if args.slots == "scattered":
        kv_indices = torch.randperm(num_slots - 1, device=device) + 1  # slot 0 unused
    else:
        kv_indices = torch.arange(1, num_slots, device=device)
    kv_indptr = torch.tensor([0, *seq_lens], device=device).cumsum(0)
    q = torch.randn(args.batch, args.heads, args.head_dim, dtype=torch.bfloat16 if is_fp8 else dtype, device=device)
    return {"seq_lens": seq_lens, "k_buf": k_buf, "v_buf": v_buf, "k_scale": k_scale, "v_scale": v_scale,
            "kv_indices": kv_indices, "kv_indptr": kv_indptr, "q": q, "out": torch.empty_like(q)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pick:
        return pick(args.pick)
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA device (none found); the kernels' CPU path is the Triton "
              "interpreter, which is for tests only", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    inputs = make_inputs(args, device)
    seq_lens, k_buf, v_buf, q, out = (inputs[k] for k in ("seq_lens", "k_buf", "v_buf", "q", "out"))
    batch, total = args.batch, sum(seq_lens)
    num_sms = get_num_sms(device)
    chosen = args.num_kv_splits or choose_num_kv_splits(batch, args.kv_heads, max(seq_lens), num_sms,
                                                        DEFAULT_MAX_KV_SPLITS)
    scale = args.head_dim**-0.5
    kv_bytes = 2 * total * args.kv_heads * args.head_dim * k_buf.element_size()
    base = {
        "bench": "decode_attention",
        "device": torch.cuda.get_device_name(device),
        "num_sms": num_sms,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join([sys.executable, "-m", "radixmesh.kernels.bench_decode", *sys.argv[1:]]),
        "batch": batch, "seq_len": args.seq_len, "min_seq_len": args.min_seq_len,
        "mean_seq_len": round(total / batch, 1), "slots": args.slots, "heads": args.heads,
        "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": args.dtype,
        "cuda_graph": args.cuda_graph, "iters": args.iters, "warmup": args.warmup, "kv_bytes": kv_bytes,
    }

    def measure(num_kv_splits: int, tiles: tuple[int, int, int] | None, head_major: bool,
                widen: str) -> dict[str, object]:
        scratch = DecodeScratch.allocate(batch, args.heads, args.head_dim, num_kv_splits, device)

        def run() -> None:
            decode_attention_fwd(q, k_buf, v_buf, out, inputs["kv_indptr"], inputs["kv_indices"], scale,
                                 num_kv_splits, scratch, inputs["k_scale"], inputs["v_scale"], tiles=tiles,
                                 head_major=head_major, fp8_widen=widen)

        max_abs_err = None
        if args.check:
            run()
            k_ref, v_ref = (k_buf.float() * inputs["k_scale"], v_buf.float() * inputs["v_scale"])
            expected = attention_reference(q.float(), k_ref, v_ref, list(range(batch + 1)),
                                           inputs["kv_indptr"].tolist(), inputs["kv_indices"], scale)
            max_abs_err = (out.float() - expected).abs().max().item()
        times_ms = (time_graph_ms if args.cuda_graph else time_median_ms)(run, args.warmup, args.iters)
        median_ms = statistics.median(times_ms)
        return {
            **base, "num_kv_splits": num_kv_splits, "tiles": list(tiles) if tiles else "default",
            "head_major": head_major, "fp8_widen": widen if k_buf.dtype in FP8_DTYPES else None,
            "median_us": round(median_ms * 1e3, 2),
            "p10_us": round(statistics.quantiles(times_ms, n=10)[0] * 1e3, 2) if len(times_ms) > 1 else None,
            "kv_read_tb_per_s": round(kv_bytes / (median_ms * 1e-3) / 1e12, 3),
            "max_abs_err": max_abs_err,
        }

    if not args.sweep:  # the kernel's defaults: head-major grid, its tiles
        print(json.dumps(measure(chosen, None, True, args.fp8_widen)))
        return 0
    sweep(args, base, chosen, measure)
    return 0


def sweep(args: argparse.Namespace, base: dict[str, object], chosen: int,
          measure: Callable[[int, tuple[int, int, int] | None, bool, str], dict[str, object]]) -> None:
    """One JSON line per (grid order, tiles, widening, splits), then the best of them."""
    best: dict[str, object] | None = None
    widens = args.sweep_widen if DTYPES[args.dtype] in FP8_DTYPES else ["f32"]
    for head_major in (True,) if args.grid_orders == "head-major" else (False, True):
        for tiles in args.sweep_tiles:
            for widen in widens:
                for splits in sorted({chosen, *args.sweep_splits}):
                    try:
                        row = measure(splits, tiles, head_major, widen)
                    except Exception as exc:  # a tile past the shared-memory limit: report it, go on
                        print(json.dumps({**base, "num_kv_splits": splits, "tiles": list(tiles),
                                          "head_major": head_major, "fp8_widen": widen,
                                          "error": str(exc)[:200]}), flush=True)
                        continue
                    row["chosen_splits"] = splits == chosen
                    print(json.dumps(row), flush=True)
                    if best is None or row["median_us"] < best["median_us"]:  # type: ignore[operator]
                        best = row
    if best is not None:
        keys = ("num_kv_splits", "tiles", "head_major", "fp8_widen", "median_us", "kv_read_tb_per_s")
        print(json.dumps({"sweep_best": {k: best[k] for k in keys}, "batch": args.batch,
                          "mean_seq_len": base["mean_seq_len"], "slots": args.slots, "dtype": args.dtype}))


def pick(paths: list[str]) -> int:
    """Print `RADIXMESH_DECODE_FP8_TILES=... RADIXMESH_DECODE_FP8_WIDEN=...`: the FP8 (tiles, widening) with the
    least summed time over the sweeps' batches, at the engine's split counts, head-major, checked rows only."""
    times: dict[tuple[tuple[int, ...], str], dict[int, float]] = {}
    batches: set[int] = set()
    for path in paths:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line) if line.startswith("{") else {}
            if row.get("dtype") != "fp8_e4m3" or "median_us" not in row or not row.get("chosen_splits") \
                    or not row.get("head_major") or row.get("tiles") == "default":
                continue
            if row.get("max_abs_err") is not None and row["max_abs_err"] > PICK_MAX_ABS_ERR:
                continue
            batches.add(row["batch"])
            key = (tuple(row["tiles"]), row["fp8_widen"])
            times.setdefault(key, {})[row["batch"]] = row["median_us"]
    complete = {key: sum(by_batch.values()) for key, by_batch in times.items() if set(by_batch) == batches}
    if not complete:
        print("no FP8 sweep line measured every batch at the chosen split count", file=sys.stderr)
        return 1
    (tiles, widen), total_us = min(complete.items(), key=lambda item: item[1])
    default = complete.get((SWEEP_TILES_FP8[0], "f32"))
    print(f"# best of {len(complete)} FP8 tiles x widenings over batches {sorted(batches)}: {total_us:.1f} us"
          + (f" (the defaults 64,4,2 f32: {default:.1f} us)" if default is not None else ""), file=sys.stderr)
    print(f"RADIXMESH_DECODE_FP8_TILES={','.join(map(str, tiles))} RADIXMESH_DECODE_FP8_WIDEN={widen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
