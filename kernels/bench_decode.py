"""Micro-benchmark of the split-KV decode kernel; prints one JSON object.

    python -m radixmesh.kernels.bench_decode --batch 64 --seq-len 2048 --heads 32 --kv-heads 8 \
        --head-dim 128 --dtype bf16

Every request has `--seq-len` tokens whose KV slots are scattered over the pool at random
(page size 1, as after many requests came and went). Time is the median of per-launch
CUDA-event timings after warmup; bandwidth counts the bytes of K and V read once.
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=2048, help="KV tokens per request")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--num-kv-splits", type=int, default=0, help="0: choose from length and SM count")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--cuda-graph", action="store_true", help="time replays of a captured graph (no launch cost)")
    p.add_argument("--check", action="store_true", help="compare the output with the PyTorch reference first")
    args = p.parse_args(argv)
    for name in ("batch", "seq_len", "heads", "kv_heads", "head_dim", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.heads % args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA device (none found); the kernels' CPU path is the Triton "
              "interpreter, which is for tests only", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    batch, seq_len = args.batch, args.seq_len
    num_slots = batch * seq_len + 1
    k_buf = torch.randn(num_slots, args.kv_heads, args.head_dim, dtype=dtype, device=device)
    v_buf = torch.randn_like(k_buf)
    kv_indices = torch.randperm(num_slots - 1, device=device) + 1  # scattered slots, slot 0 unused
    kv_indptr = torch.arange(0, batch + 1, device=device) * seq_len
    q = torch.randn(batch, args.heads, args.head_dim, dtype=dtype, device=device)
    out = torch.empty_like(q)
    num_sms = get_num_sms(device)
    num_kv_splits = args.num_kv_splits or choose_num_kv_splits(batch, args.kv_heads, seq_len, num_sms,
                                                               DEFAULT_MAX_KV_SPLITS)
    scratch = DecodeScratch.allocate(batch, args.heads, args.head_dim, num_kv_splits, device)
    scale = args.head_dim**-0.5

    def run() -> None:
        decode_attention_fwd(q, k_buf, v_buf, out, kv_indptr, kv_indices, scale, num_kv_splits, scratch)

    max_abs_err = None
    if args.check:
        run()
        expected = attention_reference(q, k_buf, v_buf, list(range(batch + 1)), kv_indptr.tolist(), kv_indices,
                                       scale)
        max_abs_err = (out.float() - expected).abs().max().item()
    fn = run
    if args.cuda_graph:
        run()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        fn = graph.replay
    times_ms = time_median_ms(fn, args.warmup, args.iters)
    median_ms = statistics.median(times_ms)
    kv_bytes = 2 * batch * seq_len * args.kv_heads * args.head_dim * k_buf.element_size()
    result = {
        "bench": "decode_attention",
        "device": torch.cuda.get_device_name(device),
        "num_sms": num_sms,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join([sys.executable, "-m", "radixmesh.kernels.bench_decode", *sys.argv[1:]]),
        "batch": batch, "seq_len": seq_len, "heads": args.heads, "kv_heads": args.kv_heads,
        "head_dim": args.head_dim, "dtype": args.dtype, "num_kv_splits": num_kv_splits,
        "cuda_graph": args.cuda_graph, "iters": args.iters, "warmup": args.warmup,
        "median_us": round(median_ms * 1e3, 2),
        "p10_us": round(statistics.quantiles(times_ms, n=10)[0] * 1e3, 2) if len(times_ms) > 1 else None,
        "kv_bytes": kv_bytes,
        "kv_read_tb_per_s": round(kv_bytes / (median_ms * 1e-3) / 1e12, 3),
        "max_abs_err": max_abs_err,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
