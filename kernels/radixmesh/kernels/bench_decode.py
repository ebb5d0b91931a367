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
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch
import triton

from radixmesh.kernels.decode_attention import (
    DEFAULT_MAX_KV_SPLITS,
    DecodeScratch,
    choose_num_kv_splits,
    decode_attention_fwd,
    get_num_sms,
)
from radixmesh.kernels.reference import attention_reference

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (BLOCK_N, num_warps, num_stages) tried by --sweep
SWEEP_TILES = ((64, 4, 2), (32, 4, 2), (32, 4, 3), (64, 4, 3), (64, 8, 2), (128, 8, 2), (16, 4, 4))


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
                   help="BLOCK_N,num_warps,num_stages for each tile to sweep")
    args = p.parse_args(argv)
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA device (none found); the kernels' CPU path is the Triton "
              "interpreter, which is for tests only", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    batch = args.batch
    seq_lens = seq_lens_for(args)
    total = sum(seq_lens)
    num_slots = total + 1
    k_buf = torch.randn(num_slots, args.kv_heads, args.head_dim, dtype=dtype, device=device)
    v_buf = torch.randn_like(k_buf)
    if args.slots == "scattered":
        kv_indices = torch.randperm(num_slots - 1, device=device) + 1  # slot 0 unused
    else:
        kv_indices = torch.arange(1, num_slots, device=device)
    kv_indptr = torch.tensor([0, *seq_lens], device=device).cumsum(0)
    q = torch.randn(batch, args.heads, args.head_dim, dtype=dtype, device=device)
    out = torch.empty_like(q)
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

    def measure(num_kv_splits: int, tiles: tuple[int, int, int] | None, head_major: bool) -> dict[str, object]:
        scratch = DecodeScratch.allocate(batch, args.heads, args.head_dim, num_kv_splits, device)

        def run() -> None:
            decode_attention_fwd(q, k_buf, v_buf, out, kv_indptr, kv_indices, scale, num_kv_splits, scratch,
                                 tiles=tiles, head_major=head_major)

        max_abs_err = None
        if args.check:
            run()
            expected = attention_reference(q, k_buf, v_buf, list(range(batch + 1)), kv_indptr.tolist(), kv_indices,
                                           scale)
            max_abs_err = (out.float() - expected).abs().max().item()
        times_ms = (time_graph_ms if args.cuda_graph else time_median_ms)(run, args.warmup, args.iters)
        median_ms = statistics.median(times_ms)
        return {
            **base, "num_kv_splits": num_kv_splits, "tiles": list(tiles) if tiles else "default",
            "head_major": head_major,
            "median_us": round(median_ms * 1e3, 2),
            "p10_us": round(statistics.quantiles(times_ms, n=10)[0] * 1e3, 2) if len(times_ms) > 1 else None,
            "kv_read_tb_per_s": round(kv_bytes / (median_ms * 1e-3) / 1e12, 3),
            "max_abs_err": max_abs_err,
        }

    if not args.sweep:
        print(json.dumps(measure(chosen, None, True)))  # the kernel's defaults: head-major grid, its tiles
        return 0
    best: dict[str, object] | None = None
    for head_major in (False, True):
        for tiles in args.sweep_tiles:
            for splits in sorted({chosen, *args.sweep_splits}):
                try:
                    row = measure(splits, tiles, head_major)
                except Exception as exc:  # a tile past the shared-memory limit: report it, go on
                    print(json.dumps({**base, "num_kv_splits": splits, "tiles": list(tiles),
                                      "head_major": head_major, "error": str(exc)[:200]}), flush=True)
                    continue
                row["chosen_splits"] = splits == chosen
                print(json.dumps(row), flush=True)
                if best is None or row["median_us"] < best["median_us"]:  # type: ignore[operator]
                    best = row
    if best is not None:
        print(json.dumps({"sweep_best": {k: best[k] for k in ("num_kv_splits", "tiles", "head_major", "median_us",
                                                               "kv_read_tb_per_s")}, "batch": batch,
                          "mean_seq_len": base["mean_seq_len"], "slots": args.slots}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
