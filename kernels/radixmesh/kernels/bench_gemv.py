"""Batch-1 linear layers: the GEMV kernel against PyTorch's (cuBLAS) at real model shapes; JSON lines.

    python -m radixmesh.kernels.bench_gemv --shapes llama-3.2-1b llama-3.1-8b [--sweep]

Each layer's weights are copied enough times to exceed the L2 cache, and one CUDA graph calls
the layer once per copy in turn, so every call reads its weights from memory, as a decode step
does. Time is the graph's median replay time divided by the number of calls; bandwidth counts
the weight bytes. `--sweep` also times a grid of kernel configurations and reports the best.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
from collections.abc import Callable

import torch

from radixmesh.kernels.gemv import GemvConfig, default_config, gemv

# (name, N, K) per layer: stacked q/k/v, o, stacked gate/up, down, lm_head
SHAPES: dict[str, list[tuple[str, int, int]]] = {
    "llama-3.2-1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
                     ("lm_head", 128256, 2048)],
    "llama-3.1-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
                     ("lm_head", 128256, 4096)],
    # one rank's shards at tensor-parallel size 2 (docs/tensor-parallel.md)
    "llama-3.1-8b-tp2": [("qkv", 3072, 4096), ("o", 4096, 2048), ("gate_up", 14336, 4096), ("down", 4096, 7168),
                         ("lm_head", 64128, 4096)],
}
SWEEP = [GemvConfig(bn, bk, warps, stages) for bn in (4, 8, 16, 32, 64) for bk in (128, 256, 512, 1024)
         for warps in (4, 8) for stages in (2, 4) if 1024 <= bn * bk <= 16384]
L2_SPAN_BYTES = 256 << 20  # weights touched per graph: several times an H100's 50 MB L2


def time_per_call_ms(calls: list[Callable[[], object]], reps: int = 20) -> float:
    """Median over `reps` replays of a graph making all `calls`, divided by their number."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compile and warm outside the graph
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) / len(calls)


def bench_layer(shape: str, name: str, n: int, k: int, dtype: torch.dtype, sweep: bool) -> dict[str, object]:
    copies = max(2, math.ceil(L2_SPAN_BYTES / (n * k * dtype.itemsize)))
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    outs = [torch.empty(1, n, device="cuda", dtype=dtype) for _ in range(copies)]
    want = torch.nn.functional.linear(x.float(), weights[0].float())
    got = gemv(x, weights[0])
    err = float((got.float() - want).norm() / want.norm())
    assert err < 2e-2, f"{shape} {name}: relative error {err:.3g} against float32"

    def calls(fn: Callable[[torch.Tensor, torch.Tensor], object]) -> list[Callable[[], object]]:
        return [functools.partial(fn, w, o) for w, o in zip(weights, outs)]

    def ours(cfg: GemvConfig | None) -> float:
        return time_per_call_ms(calls(lambda w, o: gemv(x, w, o, cfg)))

    torch_ms = time_per_call_ms(calls(lambda w, o: torch.matmul(x, w.t(), out=o)))
    default_ms = ours(None)
    nbytes = n * k * dtype.itemsize
    result: dict[str, object] = {
        "bench": "gemv", "shape": shape, "layer": name, "n": n, "k": k, "dtype": str(dtype).removeprefix("torch."),
        "gpu": torch.cuda.get_device_name(), "rel_err": round(err, 5),
        "torch_us": round(torch_ms * 1000, 2), "torch_tb_s": round(nbytes / torch_ms / 1e9, 3),
        "default_config": vars(default_config(n, k)), "default_us": round(default_ms * 1000, 2),
        "default_tb_s": round(nbytes / default_ms / 1e9, 3),
    }
    if sweep:
        timed = sorted(((ours(cfg), cfg) for cfg in SWEEP), key=lambda pair: pair[0])
        best_ms, best = timed[0]
        result |= {"best_config": vars(best), "best_us": round(best_ms * 1000, 2),
                   "best_tb_s": round(nbytes / best_ms / 1e9, 3)}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    p.add_argument("--sweep", action="store_true", help="also time a grid of kernel configurations")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemv needs a CUDA device", file=sys.stderr)
        return 2
    for shape in args.shapes:
        for name, n, k in SHAPES[shape]:
            print(json.dumps(bench_layer(shape, name, n, k, torch.bfloat16, args.sweep)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
