"""Micro-benchmark of the extend (prefill) attention kernel; prints one JSON object per shape and tiles.

    python -m radixmesh.kernels.bench_extend --new-len 1024 2048 4096 --sweep --sdpa

Each shape is `--requests` requests of `--new-len` new tokens over `--prefix-len` cached ones,
their KV slots scattered over the pool (page size 1). TFLOP/s counts the causal half of the new
tokens' square plus the full prefix: 4 * head_dim * heads * (new^2 / 2 + new * prefix) per request.
The Triton kernel is timed in CUDA graph replays (device time, not its launch).
The default tiles run in both block orders (`heavy_first`: the last query blocks, which see the most
keys, dispatched first; or the natural order) and with the new tokens' K/V read both ways (`new_kv`:
`rows`, the pass's own k/v rows, strided as views of the stacked q/k/v projection, as the engine passes
them; `slots`, gathered from the pool through the slot list); `--sweep` tiles read rows. `--sdpa` also
times torch's scaled_dot_product_attention (each backend that runs) on the same queries with contiguous
K/V and no prefix: what the kernel would gain from a library kernel. `--kernel-file` times another
revision's kernel file instead, for an A/B on one machine with the same harness.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import sys
from collections.abc import Callable

import torch
import triton

from radixmesh.kernels.bench_decode import time_graph_ms, time_median_ms
from radixmesh.kernels.extend_attention import extend_attention_fwd
from radixmesh.kernels.reference import attention_reference

SWEEP = [(128, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2),
         (64, 64, 4, 3), (64, 64, 4, 4), (256, 32, 8, 3), (256, 64, 8, 2), (128, 32, 8, 4), (128, 32, 4, 4),
         (128, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 4), (128, 128, 8, 3), (256, 64, 8, 3)]
"""(BLOCK_M, BLOCK_N, num_warps, num_stages) tried by `--sweep`, after the default."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new-len", type=int, nargs="+", default=[2048], help="new tokens per request")
    p.add_argument("--prefix-len", type=int, default=0, help="cached tokens per request")
    p.add_argument("--requests", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--sweep", action="store_true", help="also try the tiles in SWEEP")
    p.add_argument("--sdpa", action="store_true", help="also time torch SDPA backends (no prefix)")
    p.add_argument("--check", action="store_true", help="compare each run with the PyTorch reference")
    p.add_argument("--churn", type=int, default=0,
                   help="also time SDPA's first call at this many new lengths after --new-len (a plan per shape?)")
    p.add_argument("--kernel-file", default=None,
                   help="time the extend_attention_fwd of this file instead (another revision's "
                        "kernels/radixmesh/kernels/extend_attention.py, e.g. from "
                        "`git show REV:kernels/radixmesh/kernels/extend_attention.py`); a version "
                        "without k_new reads every K/V through the slots, so it runs the slot rows only")
    args = p.parse_args(argv)
    if min(args.new_len) < 1 or args.prefix_len < 0 or args.requests < 1 or args.heads % args.kv_heads:
        p.error("need new lengths >= 1, prefix >= 0, requests >= 1, heads a multiple of kv heads")
    return args


def _flops(args: argparse.Namespace, new: int) -> float:
    return 4.0 * args.head_dim * args.heads * args.requests * (new * new / 2 + new * args.prefix_len)


def bench_shape(args: argparse.Namespace, new: int, kernel: tuple[Callable[..., None], str, bool]
                ) -> list[dict[str, object]]:
    """Rows for one length; `kernel`: `load_kernel`'s (function, label, reads rows)."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    seq = args.prefix_len + new
    num_slots = args.requests * seq + 1
    k_buf = torch.randn(num_slots, args.kv_heads, args.head_dim, dtype=dtype, device=device)
    v_buf = torch.randn_like(k_buf)
    kv_indices = (torch.randperm(num_slots - 1, device=device) + 1).to(torch.int64)
    kv_indptr = torch.arange(0, args.requests + 1, device=device) * seq
    qo_indptr = torch.arange(0, args.requests + 1, device=device) * new
    q = torch.randn(args.requests * new, args.heads, args.head_dim, dtype=dtype, device=device)
    # the new tokens' own k/v rows: views of a stacked q/k/v projection, holding what their slots hold
    qkv = torch.empty(args.requests * new, args.heads + 2 * args.kv_heads, args.head_dim, dtype=dtype, device=device)
    k_new, v_new = qkv[:, args.heads:args.heads + args.kv_heads], qkv[:, args.heads + args.kv_heads:]
    new_slots = kv_indices.view(args.requests, seq)[:, args.prefix_len:].reshape(-1)
    k_new.copy_(k_buf[new_slots])
    v_new.copy_(v_buf[new_slots])
    out = torch.empty_like(q)
    scale = args.head_dim**-0.5
    base = {"bench": "extend_attention", "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "triton": triton.__version__, "requests": args.requests, "new_len": new, "prefix_len": args.prefix_len,
            "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim}
    rows = []
    fwd, label, reads_rows = kernel
    read = "rows" if reads_rows else "slots"  # the default read, then the slots (a kernel with both reads)
    configs: list[tuple[tuple[int, int, int, int] | None, bool, str]] = [(None, True, read)]
    configs += [(None, True, "slots")] if reads_rows else []
    configs += [(None, False, read)] + [(b, True, read) for b in (SWEEP if args.sweep else [])]
    for blocks, heavy_first, new_kv in configs:
        def run(blocks: tuple[int, int, int, int] | None = blocks, heavy_first: bool = heavy_first,
                own_rows: bool = new_kv == "rows") -> None:
            extra = {"k_new": k_new, "v_new": v_new} if own_rows else {}
            fwd(q, k_buf, v_buf, out, qo_indptr, kv_indptr, kv_indices, new, scale, blocks=blocks,
                heavy_first=heavy_first, **extra)

        try:
            run()
        except Exception as exc:  # a tile that does not compile (shared memory) is reported, not fatal
            rows.append({**base, "kernel": label, "blocks": blocks, "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        err = None
        if args.check:
            ref = attention_reference(q, k_buf, v_buf, qo_indptr.tolist(), kv_indptr.tolist(), kv_indices, scale)
            err = round((out.float() - ref).abs().max().item(), 5)
        ms = statistics.median(time_graph_ms(run, args.warmup, args.iters))
        rows.append({**base, "kernel": label, "blocks": blocks or "default", "heavy_first": heavy_first,
                     "new_kv": new_kv,
                     "median_us": round(ms * 1e3, 1),
                     "tflops": round(_flops(args, new) / ms / 1e9, 1), "max_abs_err": err})
    if args.sdpa and args.prefix_len == 0:
        rows += _sdpa_rows(args, base, q, new)
    return rows


def load_kernel(path: str | None) -> tuple[Callable[..., None], str, bool]:
    """(extend_attention_fwd, its label in the rows, whether it takes k_new/v_new): this tree's, or `path`'s."""
    if path is None:
        return extend_attention_fwd, "triton", True
    spec = importlib.util.spec_from_file_location("extend_attention_under_test", path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fwd = module.extend_attention_fwd
    return fwd, f"triton:{path}", "k_new" in inspect.signature(fwd).parameters


def _sdpa_rows(args: argparse.Namespace, base: dict[str, object], q: torch.Tensor, new: int) -> list[dict[str, object]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qh = q.view(args.requests, new, args.heads, args.head_dim).transpose(1, 2)
    kh = torch.randn(args.requests, args.kv_heads, new, args.head_dim, dtype=q.dtype, device=q.device)
    vh = torch.randn_like(kh)
    rows = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def run(backend: SDPBackend = backend) -> None:
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)

        try:
            run()
            ms = statistics.median(time_median_ms(run, args.warmup, args.iters))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:200]
            rows.append({**base, "kernel": f"sdpa-{backend.name.lower()}", "error": error})
            continue
        rows.append({**base, "kernel": f"sdpa-{backend.name.lower()}", "median_us": round(ms * 1e3, 1),
                     "tflops": round(_flops(args, new) / ms / 1e9, 1)})
    return rows


def _churn_rows(args: argparse.Namespace, new: int) -> list[dict[str, object]]:
    """Host wall time of SDPA (cuDNN first) on `args.churn` lengths never seen before, then again on each."""
    import time

    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows: list[dict[str, object]] = []
    for label, order in (("cudnn", [SDPBackend.CUDNN_ATTENTION]), ("flash", [SDPBackend.FLASH_ATTENTION])):
        first: list[float] = []
        again: list[float] = []
        for i in range(args.churn):
            n = new + 1 + i
            qh = torch.randn(1, args.heads, n, args.head_dim, dtype=torch.bfloat16, device="cuda")
            kh = torch.randn(1, args.kv_heads, n, args.head_dim, dtype=torch.bfloat16, device="cuda")
            for times in (first, again):
                torch.cuda.synchronize()
                start = time.perf_counter()
                with sdpa_kernel(order):
                    torch.nn.functional.scaled_dot_product_attention(qh, kh, kh, is_causal=True, enable_gqa=True)
                torch.cuda.synchronize()
                times.append(1000 * (time.perf_counter() - start))
        rows.append({"bench": "extend_attention_churn", "kernel": f"sdpa-{label}", "new_len": new,
                     "lengths": args.churn, "first_call_ms_median": round(statistics.median(first), 3),
                     "repeat_call_ms_median": round(statistics.median(again), 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_extend needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    kernel = load_kernel(args.kernel_file)  # once: each load is a new jit function, compiled again
    rows_by_len = [(new, bench_shape(args, new, kernel)) for new in args.new_len]
    if args.churn:
        rows_by_len.append((args.new_len[0], _churn_rows(args, args.new_len[0])))
    for _, rows in rows_by_len:
        for row in rows:
            row["command"] = " ".join([sys.executable, "-m", "radixmesh.kernels.bench_extend", *sys.argv[1:]])
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
