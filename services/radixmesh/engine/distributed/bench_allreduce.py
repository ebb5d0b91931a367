"""All-reduce at decode sizes across the ranks of one host: eager and inside a CUDA graph; JSON lines.

    python -m radixmesh.engine.distributed.bench_allreduce --tp-size 2 --rows 1 8 64 [--result-file F]

A decode step of a Llama model at TP N makes two all-reduces per layer of `[batch, hidden]`
(64 for the 8B's 32 layers); at batch 1 they are latency-bound, which decides how much TP
speeds a batch-1 step up. Each size is timed eagerly (CUDA events around `iters` calls) and as
one CUDA graph holding `graph_calls` all-reduces (how a captured decode step runs them). The
copy bandwidth of every GPU is measured in the same run (the bandwidth floor of a step). On the
CPU (gloo) only the eager figure is taken. `--custom` adds the one-shot kernel over CUDA IPC
(`--enable-custom-all-reduce`) for the sizes it takes; each way checks its sum of ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from radixmesh.engine.distributed.comm import TorchCommunicator, rank_device

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def copy_bandwidth_tb_s(device: torch.device, num_bytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy: (bytes read + bytes written) / time, in TB/s."""
    src = torch.empty(num_bytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * num_bytes * reps / (start.elapsed_time(end) / 1000) / 1e12


def _eager_us(all_reduce: Callable[[torch.Tensor], Any], x: torch.Tensor, iters: int) -> float:
    for _ in range(5):
        all_reduce(x)
    if x.is_cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            all_reduce(x)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        all_reduce(x)
    return (time.perf_counter() - t0) * 1e6 / iters


def _graph_us(all_reduce: Callable[[torch.Tensor], Any], x: torch.Tensor, calls: int, reps: int = 10) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            all_reduce(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                all_reduce(x)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def _rank(rank: int, args: argparse.Namespace, init_method: str, results: Any) -> None:
    device = rank_device(args.device, rank)
    comm = TorchCommunicator.init(rank, args.tp_size, init_method, device)
    dtype = DTYPES[args.dtype]
    bandwidth = torch.tensor([copy_bandwidth_tb_s(device) if device.type == "cuda" else 0.0], device=device)
    bandwidths = comm.all_gather(bandwidth).flatten().tolist()
    ways: dict[str, Callable[[torch.Tensor], Any]] = {"nccl" if device.type == "cuda" else "gloo": dist.all_reduce}
    custom = None
    if args.custom:
        from radixmesh.engine.distributed.custom_all_reduce import BENCH_MAX_BYTES, CustomAllReduce

        custom = CustomAllReduce.over_cuda_ipc(rank, args.tp_size, device, max_bytes=BENCH_MAX_BYTES)
        if custom is not None:
            ways["custom"] = custom.all_reduce
    rows_out = []
    for rows in args.rows:
        row: dict[str, Any] = {"rows": rows, "bytes": rows * args.hidden * torch.finfo(dtype).bits // 8}
        for name, all_reduce in ways.items():
            x = torch.ones(rows, args.hidden, dtype=dtype, device=device)
            if name == "custom" and custom is not None and not custom.can_run(x):
                continue
            all_reduce(x)
            row[f"{name}_correct"] = bool((x == args.tp_size).all())
            row[f"{name}_eager_us"] = round(_eager_us(all_reduce, x, args.iters), 2)
            if device.type == "cuda":
                row[f"{name}_graph_us"] = round(_graph_us(all_reduce, x, args.graph_calls), 2)
        rows_out.append(row)
    if rank == 0:
        results.put({"bandwidths": bandwidths, "rows": rows_out,
                     "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"})
    TorchCommunicator.destroy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=4096, help="row width (the model's hidden size)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--graph-calls", type=int, default=64, help="all-reduces per captured graph (8B decode: 64)")
    parser.add_argument("--custom", action="store_true",
                        help="also time the one-shot CUDA-IPC all-reduce (--enable-custom-all-reduce) where it fits")
    parser.add_argument("--result-file", default=None, help="append the JSON lines to this file")
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.tp_size:
        print(f"bench_allreduce: --tp-size {args.tp_size} needs {args.tp_size} GPUs; "
              f"{torch.cuda.device_count()} are visible", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [ctx.Process(target=_rank, args=(rank, args, init_method, results)) for rank in range(args.tp_size)]
        for proc in procs:
            proc.start()
        result = results.get()
        for proc in procs:
            proc.join()
    for row in result["rows"]:
        line = {"bench": "allreduce", "device": result["gpu"], "tp_size": args.tp_size, "dtype": args.dtype,
                "hidden": args.hidden, **row, "graph_calls": args.graph_calls,
                "copy_bandwidth_tb_s": [round(b, 3) for b in result["bandwidths"]] if args.device == "cuda" else None,
                "command": " ".join(sys.argv)}
        print(json.dumps(line))
        if args.result_file:
            with open(args.result_file, "a") as fh:
                fh.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
