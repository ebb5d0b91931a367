"""The one-shot all-reduce kernel compiled for the GPU, over real CUDA IPC mappings, eager and replayed in a
CUDA graph, between two processes.

It needs one GPU only: both rank processes use GPU 0 (the GPU time-slices their spinning kernels,
so this is slow but exact). With two GPUs the ranks sit on one GPU each and the flags and reads
cross NVLink, as in a tensor-parallel worker (`test_tensor_parallel_gpu.py` runs it there).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SIZES = [1, 4096, 65536, 300000]
GRAPH_CALLS, GRAPH_REPLAYS = 8, 3


def _input(rank: int, i: int, n: int, device: torch.device) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(100 * i + rank)) * 2).to(torch.bfloat16).to(device)


def _rank(rank: int, world: int, up: Any, down: Any, results: Any, two_gpus: bool) -> None:
    from radixmesh.engine.distributed.custom_all_reduce import BENCH_MAX_BYTES, CustomAllReduce

    device = torch.device("cuda", rank if two_gpus else 0)
    torch.cuda.set_device(device)

    def all_gather(obj: Any) -> list[Any]:
        up.put((rank, obj))
        return down.get(timeout=120)

    # the largest buffer (the engine's default carries up to 256 KiB; 300,000 bf16 values are 600 KB)
    reducer = CustomAllReduce.over_cuda_ipc(rank, world, device, max_bytes=BENCH_MAX_BYTES, all_gather=all_gather)
    assert reducer is not None, "no peer access"
    eager = []
    for i, n in enumerate(SIZES):
        x = _input(rank, i, n, device)
        reducer.all_reduce(x)
        eager.append(x.float().cpu().numpy())
    ones = torch.full((4096,), float(rank + 1), dtype=torch.bfloat16, device=device)
    static = torch.empty_like(ones)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        reducer.all_reduce(static.copy_(ones))  # warm up (compile) outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(GRAPH_CALLS):
                reducer.all_reduce(static.copy_(ones))
    for _ in range(GRAPH_REPLAYS):
        graph.replay()
    torch.cuda.synchronize()
    results.put((rank, eager, static.float().cpu().numpy(), reducer.counters.cpu().tolist()))


@pytest.mark.parametrize("two_gpus", [False, True], ids=["one-gpu", "two-gpus"])
def test_one_shot_all_reduce_between_two_processes(two_gpus: bool) -> None:
    if two_gpus and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    world = 2
    ctx = mp.get_context("spawn")
    up, results = ctx.Queue(), ctx.Queue()
    downs = [ctx.Queue() for _ in range(world)]
    procs = [ctx.Process(target=_rank, args=(r, world, up, downs[r], results, two_gpus)) for r in range(world)]
    for proc in procs:
        proc.start()
    got: dict[int, Any] = {}
    pending: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + 120
        while len(got) < world:  # broker of the ranks' all_gather rounds, until both report
            assert time.monotonic() < deadline, "the ranks did not finish in 120 s (a hang?)"
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not failed, f"a rank process failed with exit code {failed[0]}"
            try:
                rank, obj = up.get(timeout=0.5)
                pending[rank] = obj
                if len(pending) == world:
                    for down in downs:
                        down.put([pending[r] for r in range(world)])
                    pending = {}
            except queue.Empty:
                pass
            try:
                rank, *rest = results.get_nowait()
                got[rank] = rest
            except queue.Empty:
                pass
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    for i, n in enumerate(SIZES):
        want = (_input(0, i, n, torch.device("cpu")).float() + _input(1, i, n, torch.device("cpu")).float())
        want = want.to(torch.bfloat16).float().numpy()
        assert (got[0][0][i] == got[1][0][i]).all(), f"size {n}: the ranks differ"
        assert (got[0][0][i] == want).all(), f"size {n}: not the rounded fp32 sum"
    for rank in range(world):
        assert (got[rank][1] == 3.0).all()  # 1 + 2, every replay from fresh inputs
    calls = len(SIZES) + 1 + GRAPH_CALLS * GRAPH_REPLAYS  # program 0 takes part in every call
    assert got[0][2][0] == got[1][2][0] == calls
