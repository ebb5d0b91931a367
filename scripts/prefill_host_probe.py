"""Host time of the launches an eager 8B prefill makes, per call, with the device kept busy (so nothing waits on it).

    python scripts/prefill_host_probe.py [--tokens 64 512 1615 2499 3626] [--out FILE.jsonl]

For each prompt length: the four projections of a layer through `F.linear` (what `Linear` runs at more than one
row), the same with `torch.mm(..., out=)` into kept buffers, with a new row count every call (cuBLAS' shape
heuristics missing) against the same one, and the project's Triton launches of a layer (add + RMSNorm, SiLU-and-mul).
Also the caching allocator's device allocations and retries during the calls. One JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

HIDDEN, INTER, Q, KV = 4096, 14336, 4096, 1024
CALLS = 32
SLEEP_CYCLES = 4_000_000_000  # ~2 s of device time: every launch below only queues


def busy() -> None:
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)


def alloc_counts() -> tuple[int, int]:
    s = torch.cuda.memory_stats()
    return s.get("num_device_alloc", 0), s.get("num_alloc_retries", 0)


def timed(name: str, tokens: int, fn, calls: int, results: list[dict]) -> None:
    fn(0)  # first call outside the timing
    busy()
    a0, r0 = alloc_counts()
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    host = (time.perf_counter() - t0) / calls * 1e6
    a1, r1 = alloc_counts()
    torch.cuda.synchronize()
    rec = {"case": name, "tokens": tokens, "host_us_per_call": round(host, 2), "device_allocs": a1 - a0,
           "alloc_retries": r1 - r0}
    results.append(rec)
    print(json.dumps(rec), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 1615, 2499, 3626])
    ap.add_argument("--out")
    ap.add_argument("--warm-ladder", action="store_true",
                    help="first run the four projections at the serving warm-up's row counts (gemm_warmup.gemm_rows)")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    w = {"qkv": torch.randn(Q + 2 * KV, HIDDEN, device=dev, dtype=dt),
         "o": torch.randn(HIDDEN, Q, device=dev, dtype=dt),
         "gate_up": torch.randn(2 * INTER, HIDDEN, device=dev, dtype=dt),
         "down": torch.randn(HIDDEN, INTER, device=dev, dtype=dt)}
    ins = {"qkv": HIDDEN, "o": Q, "gate_up": HIDDEN, "down": INTER}
    from radixmesh.kernels.fused import rms_norm, silu_and_mul

    results: list[dict] = []
    if args.warm_ladder:
        from radixmesh.engine.scheduler.gemm_warmup import gemm_rows

        t0 = time.perf_counter()
        x = torch.randn(4096, INTER, device=dev, dtype=dt)
        for n in gemm_rows(4096):
            for k in w:
                F.linear(x[:n, :ins[k]], w[k])
        torch.cuda.synchronize()
        print(json.dumps({"case": "ladder", "seconds": round(time.perf_counter() - t0, 3)}), flush=True)
    for n in args.tokens:
        xs = {k: torch.randn(n + CALLS, ins[k], device=dev, dtype=dt) for k in w}
        outs = {k: torch.empty(n + CALLS, w[k].shape[0], device=dev, dtype=dt) for k in w}

        def linear_same(i: int) -> None:
            for k in w:
                F.linear(xs[k][:n], w[k])

        def linear_new_rows(i: int) -> None:
            for k in w:
                F.linear(xs[k][:n + i], w[k])

        def mm_out(i: int) -> None:
            for k in w:
                torch.mm(xs[k][:n], w[k].t(), out=outs[k][:n])

        hidden = torch.randn(n, HIDDEN, device=dev, dtype=dt)
        residual = torch.randn(n, HIDDEN, device=dev, dtype=dt)
        norm_w = torch.ones(HIDDEN, device=dev, dtype=dt)
        gate_up = torch.randn(n, 2 * INTER, device=dev, dtype=dt)

        def triton_layer(i: int) -> None:
            rms_norm(hidden, norm_w, 1e-5, residual)
            silu_and_mul(gate_up)
            rms_norm(hidden, norm_w, 1e-5, residual)

        timed("F.linear, same rows (4 calls)", n, linear_same, CALLS, results)
        timed("F.linear, new row count each call (4 calls)", n, linear_new_rows, CALLS, results)
        timed("torch.mm out= (4 calls)", n, mm_out, CALLS, results)
        timed("triton: add-norm, silu-and-mul, add-norm (3 calls)", n, triton_layer, CALLS, results)
    if args.out:
        with open(args.out, "a") as f:
            for rec in results:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
