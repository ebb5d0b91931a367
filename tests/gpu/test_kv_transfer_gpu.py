"""KV gather/scatter kernels at a real shape (Llama-3.1-8B KV: 32 layers, 8 KV heads, head dim 128, bf16), and the
cuda-ipc transport between a prefill and a decode worker process on two GPUs."""

from __future__ import annotations

import os
import time

import grpc
import torch

if not torch.cuda.is_available():
    # every test here is skipped then, but importing the kernels must not fix triton to compiled
    # mode before the CPU unit tests (which need the interpreter) import them
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from radixmesh.kernels.kv_transfer import gather_kv, scatter_kv
from radixmesh.kernels.kv_transfer_ref import gather_kv_torch
from radixmesh.protocol import common_pb2, router_pb2, router_pb2_grpc, sampling_pb2, worker_pb2, worker_pb2_grpc
from tests.integration.service_procs import start_service

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("num_tokens", [1, 1000, 4000])
def test_gather_scatter_at_llama_8b_shape(num_tokens: int) -> None:
    device = torch.device("cuda")
    layers, slots_total, heads, dim = 32, 8192, 8, 128
    gen = torch.Generator(device=device).manual_seed(0)
    k_src = [torch.randn(slots_total, heads, dim, generator=gen, device=device).bfloat16() for _ in range(layers)]
    v_src = [torch.randn(slots_total, heads, dim, generator=gen, device=device).bfloat16() for _ in range(layers)]
    k_dst = [torch.zeros_like(b) for b in k_src]
    v_dst = [torch.zeros_like(b) for b in v_src]
    src_slots = torch.randperm(slots_total - 1, device=device)[:num_tokens] + 1
    dst_slots = torch.randperm(slots_total - 1, device=device)[:num_tokens] + 1
    packed = torch.empty(layers, 2, num_tokens, heads, dim, dtype=torch.bfloat16, device=device)
    reference = torch.empty_like(packed)
    gather_kv(k_src, v_src, src_slots, packed)
    gather_kv_torch(k_src, v_src, src_slots, reference)
    assert torch.equal(packed, reference)
    scatter_kv(k_dst, v_dst, dst_slots, packed)
    for layer in (0, 17, 31):
        assert torch.equal(k_dst[layer][dst_slots], k_src[layer][src_slots])
        assert torch.equal(v_dst[layer][dst_slots], v_src[layer][src_slots])


# ---- two worker processes on two GPUs ------------------------------------------------------------
PD_PROMPTS = [[1, *range(1000, 1300)], [1, *range(5000, 5040)], [1, *range(20000, 20700)]]


def _pd_tokens(transport: str) -> tuple[list[list[int]], worker_pb2.DisaggStats]:
    """Greedy tokens of PD_PROMPTS through a router, a prefill worker on GPU 0 and a decode worker on GPU 1
    (each sees both GPUs, its own first), with `transport`; and the decode worker's counters."""
    engine = ["--device", "cuda", "--max-total-tokens", "8192", "--kv-transport", transport, "--metrics-port", "-1"]
    procs = [start_service("worker", [*engine, "--role", "prefill"], env={"CUDA_VISIBLE_DEVICES": "0,1"})]
    try:
        procs.append(start_service("worker", [*engine, "--role", "decode"], env={"CUDA_VISIBLE_DEVICES": "1,0"}))
        procs.append(start_service("router", ["--workers", f"{procs[0].address},{procs[1].address}",
                                              "--pd-min-prefill-tokens", "1", "--health-interval-s", "0.3",
                                              "--metrics-port", "-1"]))
        router = router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(procs[2].address))
        deadline = time.monotonic() + 60
        while not _sees_both_roles(router):
            assert time.monotonic() < deadline, "the router did not see a prefill and a decode worker"
            time.sleep(0.2)
        results = []
        for ids in PD_PROMPTS:
            params = sampling_pb2.SamplingParams(max_new_tokens=16, temperature=0.0)
            msgs = list(router.Generate(worker_pb2.GenerateRequest(token_ids=ids, sampling_params=params), timeout=300))
            assert msgs[0].routing.pd_reason == "prefill-tier", msgs[0].routing
            results.append([t for m in msgs for t in m.token_ids])
        decode = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(procs[1].address))
        stats = decode.GetLoad(worker_pb2.GetLoadRequest(), timeout=30).disagg
        return results, stats
    finally:
        for proc in reversed(procs):
            proc.stop(30)


def _sees_both_roles(router: router_pb2_grpc.RouterServiceStub) -> bool:
    reply = router.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
    return {w.role for w in reply.workers if w.healthy} == {common_pb2.WORKER_ROLE_PREFILL,
                                                              common_pb2.WORKER_ROLE_DECODE}


@pytest.mark.integration
@pytest.mark.slow
def test_cuda_ipc_between_two_gpus_gives_the_grpc_tokens() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    by_grpc, grpc_stats = _pd_tokens("grpc")
    by_ipc, ipc_stats = _pd_tokens("cuda-ipc")
    assert by_ipc == by_grpc
    for stats in (grpc_stats, ipc_stats):
        assert stats.num_committed == len(PD_PROMPTS) and stats.num_fallbacks == 0, stats
    assert ipc_stats.kv_bytes_received == grpc_stats.kv_bytes_received > 0  # the same KV, moved GPU to GPU
