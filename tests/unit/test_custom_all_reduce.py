"""The one-shot all-reduce kernel, run by 2 and 3 rank processes on the CPU under the Triton interpreter.

Shared files mapped by every process stand in for the CUDA IPC mappings (each process addresses
every rank's buffer and flags at its own addresses, as with IPC), so the flags, epochs and the
two buffer halves are exercised across real processes running concurrently. On CUDA (two GPUs)
`tests/gpu/test_tensor_parallel_gpu.py` runs the same kernel over IPC, inside CUDA graphs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

MAX_BYTES = 1 << 15
MAX_PROGRAMS = 64  # radixmesh.engine.distributed.custom_all_reduce.MAX_PROGRAMS (checked below)
CALLS = [(1, torch.float32), (1000, torch.float32), (2500, torch.float32), (17, torch.bfloat16),
         (4096, torch.bfloat16), (3000, torch.float32), (5, torch.float16)]
"""(elements, dtype) of successive calls: 1 to 4 programs, each buffer half reused several times."""


def _inputs(rank: int) -> list[torch.Tensor]:
    return [(torch.randn(n, generator=torch.Generator().manual_seed(100 * i + rank)) * 3).to(dtype)
            for i, (n, dtype) in enumerate(CALLS)]


def _rank(rank: int, world: int, tmp: str, queue: Any) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported (a fresh spawned process)
    from radixmesh.engine.distributed import custom_all_reduce

    assert custom_all_reduce.MAX_PROGRAMS == MAX_PROGRAMS
    buffers = [torch.from_file(f"{tmp}/buffer-{p}", shared=True, size=2 * world * MAX_BYTES, dtype=torch.uint8)
               for p in range(world)]
    flags = [torch.from_file(f"{tmp}/flags-{p}", shared=True, size=world * MAX_PROGRAMS, dtype=torch.int32)
             for p in range(world)]
    reducer = custom_all_reduce.CustomAllReduce(rank, world, buffers, flags, torch.device("cpu"), MAX_BYTES)
    outputs = []
    for x in _inputs(rank):
        assert reducer.can_run(x)
        out = reducer.all_reduce(x)
        assert out is x  # in place
        outputs.append(out.float().tolist())  # plain lists: the process may exit before they are read
    queue.put((rank, outputs, reducer.counters.tolist()))


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_same_exact_sum(tmp_path: Path, world: int) -> None:
    for p in range(world):
        (tmp_path / f"buffer-{p}").write_bytes(bytes(2 * world * MAX_BYTES))
        (tmp_path / f"flags-{p}").write_bytes(bytes(4 * world * MAX_PROGRAMS))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(rank, world, str(tmp_path), queue)) for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        results = {rank: (outputs, counters) for rank, outputs, counters in (queue.get(timeout=240) for _ in procs)}
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    inputs = [_inputs(rank) for rank in range(world)]
    for i, (_, dtype) in enumerate(CALLS):
        want = inputs[0][i].float()
        for rank in range(1, world):
            want = want + inputs[rank][i].float()  # fp32, in rank order, as the kernel sums
        got = torch.tensor(results[0][0][i])
        for rank in range(1, world):
            assert results[rank][0][i] == results[0][0][i], f"call {i}: rank {rank} differs from rank 0"
        if dtype == torch.float32:
            assert torch.equal(got, want), f"call {i}"
        else:  # the interpreter truncates when it narrows to 16 bits (the GPU rounds): one ulp apart at most
            torch.testing.assert_close(got, want.to(dtype).float(), atol=0, rtol=2 ** -7 if dtype == torch.bfloat16
                                       else 2 ** -10)
    programs = max(1, -(-max(n for n, _ in CALLS) // 1024))
    assert results[0][1][:programs] == results[1][1][:programs]  # every program counted its calls alike
    assert results[0][1][0] == len(CALLS)


def test_the_launcher_checks_its_inputs() -> None:
    from radixmesh.kernels.allreduce import one_shot_all_reduce

    x = torch.zeros(8)
    table, counters = torch.zeros(4, dtype=torch.int64), torch.zeros(MAX_PROGRAMS, dtype=torch.int32)
    with pytest.raises(AssertionError, match="table must be int64"):
        one_shot_all_reduce(x, x, table[:3], counters, 0, 2, 1024)
    with pytest.raises(AssertionError, match="do not fit a rank's slot"):
        one_shot_all_reduce(torch.zeros(300), torch.zeros(300), table, counters, 0, 2, 1024)
    with pytest.raises(AssertionError, match="do not fit a rank's slot"):  # 2 ranks x 2 halves of 1024 bytes
        one_shot_all_reduce(torch.zeros(200), torch.zeros(200), table, counters, 0, 2, 1024)
    with pytest.raises(AssertionError, match="out is"):
        one_shot_all_reduce(x, torch.zeros(8, dtype=torch.float64), table, counters, 0, 2, 1024)
