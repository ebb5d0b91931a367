"""The host tier on CUDA: token-major kernels at the 8B KV shape, copies through pinned memory on the copy
stream (stream order keeps reused device slots safe), and the scheduler with CUDA graphs and overlap giving
the same greedy tokens with the host tier as without."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # every test here is skipped then, but importing the kernels must not fix triton to compiled
    # mode before the CPU unit tests (which need the interpreter) import them
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from radixmesh.engine.hicache.host_pool import HostKVPool
from radixmesh.engine.hicache.transfer import HostTransfer
from radixmesh.engine.hicache.tree import HiRadixCache
from radixmesh.engine.memory import TokenToKVPool
from radixmesh.engine.request import Req
from radixmesh.kernels.kv_host import gather_kv_tokens, scatter_kv_tokens
from radixmesh.kernels.kv_host_ref import gather_kv_tokens_torch
from tests.unit.scheduler_factory import (
    assert_no_leak,
    clone,
    make_requests,
    make_scheduler,
    run_until_idle,
    tiny_model_config,
)

pytestmark = pytest.mark.gpu
GPU_SHAPE = tiny_model_config(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)
"""The tiny scheduler model with a head size the Triton kernels take (tl.dot needs head_dim >= 16)."""
LAYERS, HEADS, DIM = 32, 8, 128  # Llama-3.1-8B's KV


def random_pool(num_slots: int) -> TokenToKVPool:
    pool = TokenToKVPool(num_slots, LAYERS, HEADS, DIM, torch.bfloat16, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf.copy_(torch.randn(buf.shape, generator=gen, device="cuda"))
    return pool


@pytest.mark.parametrize("num_tokens", [1, 1000, 4000])
def test_token_major_kernels_at_the_8b_shape(num_tokens: int) -> None:
    pool = random_pool(8192)
    slots = torch.randperm(8191, device="cuda")[:num_tokens] + 1
    packed = torch.empty(num_tokens, LAYERS, 2, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    reference = torch.empty_like(packed)
    gather_kv_tokens(pool.k_buffers, pool.v_buffers, slots, packed)
    gather_kv_tokens_torch(pool.k_buffers, pool.v_buffers, slots, reference)
    assert torch.equal(packed, reference)
    target = torch.randperm(8191, device="cuda")[:num_tokens] + 1
    scatter_kv_tokens(pool.k_buffers, pool.v_buffers, target, packed)
    for layer in (0, 13, 31):
        assert torch.equal(pool.k_buffers[layer][target], packed[:, layer, 0])
        assert torch.equal(pool.v_buffers[layer][target], packed[:, layer, 1])


def test_copies_through_pinned_memory_survive_immediate_reuse_of_the_device_slots() -> None:
    pool = random_pool(4096)
    host = HostKVPool(8192, LAYERS, HEADS, DIM, torch.bfloat16, pin_memory=True)
    assert host.buffer.is_pinned()
    transfer = HostTransfer(pool, host)
    src = torch.arange(1, 2001, device="cuda")
    before = torch.empty(2000, LAYERS, 2, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    gather_kv_tokens_torch(pool.k_buffers, pool.v_buffers, src, before)
    host_slots = torch.cat([torch.arange(10, 1010), torch.arange(3000, 4000)])  # two runs: two DMAs
    write = transfer.write(src, host_slots)
    for buf in (*pool.k_buffers, *pool.v_buffers):  # the slots are handed out again at once
        buf[1:2001].fill_(7.0)
    write.wait()
    transfer.finish(write)
    dst = torch.arange(2001, 4001, device="cuda")
    load = transfer.load(host_slots, dst)
    load.wait()
    transfer.finish(load)
    after = torch.empty_like(before)
    gather_kv_tokens_torch(pool.k_buffers, pool.v_buffers, dst, after)
    assert torch.equal(after, before)


def _again(req: Req) -> Req:
    again = clone(req)
    again.rid += "-again"
    return again


def _reference(reqs: list[Req]) -> dict[str, list[int]]:
    """Each request alone on a pool that holds everything, then once more from the (device) cache: the same
    kernels as a run whose cached prefix came back from the host tier."""
    sched, out = make_scheduler(GPU_SHAPE, device="cuda", max_total_tokens=8192)
    for req in reqs:
        sched.add_request(clone(req))
        run_until_idle(sched)
        sched.add_request(_again(req))
        run_until_idle(sched)
    return dict(out.tokens)


@pytest.mark.parametrize("policy", ["write-through", "write-back"])
def test_scheduler_with_graphs_and_overlap_gives_the_same_tokens_with_the_host_tier(policy: str) -> None:
    reqs = make_requests(8, seed=3, prompt_len=(60, 90), max_new_tokens=8)
    expected = _reference(reqs)
    sched, out = make_scheduler(GPU_SHAPE, device="cuda", max_total_tokens=256, enable_hierarchical_cache=True,
                                hicache_ratio=8.0, hicache_write_policy=policy)
    assert sched.config.overlap_enabled and sched.runner.graph_runner is not None
    for req in reqs:
        sched.add_request(clone(req))
        run_until_idle(sched)
    for req in reqs[:4]:  # evicted to the host by the later ones; now loaded back
        sched.add_request(_again(req))
        run_until_idle(sched)
    for req in reqs:
        assert out.tokens[req.rid] == expected[req.rid]
    for req in reqs[:4]:
        assert out.tokens[req.rid + "-again"] == expected[req.rid + "-again"]
        assert out.cached[req.rid + "-again"] >= len(req.origin_input_ids) - 1 - 16  # loaded, not recomputed
    stats = sched.stats()
    assert stats["hicache_num_loads"] >= 1 and stats["hicache_host_hit_tokens"] > 0
    tree = sched.kv.tree
    assert isinstance(tree, HiRadixCache)
    tree.complete_writes(wait=True)
    assert_no_leak(sched)
    assert tree.host_allocator.available_size() + tree.host_size() == tree.host_pool.size


# ---- prefix sharing between two worker processes on two GPUs --------------------------------------
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["grpc", "cuda-ipc"])
def test_prefix_fetched_from_a_peer_on_another_gpu_gives_the_computed_tokens(transport: str, tmp_path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    staged = os.environ.get("RADIXMESH_TEST_TOKENIZER_DIR")
    if not staged:  # the GPU machine has no network for the default model: random weights, its tokenizer
        pytest.skip("RADIXMESH_TEST_TOKENIZER_DIR (the default model's tokenizer files) is not set")
    model = tmp_path / "llama-3.2-1b"
    subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu_tokenizer_model.py"),
                    "llama-3.2-1b", staged, str(model)], check=True, capture_output=True)
    import grpc

    from radixmesh.protocol import sampling_pb2, worker_pb2, worker_pb2_grpc
    from tests.integration.service_procs import start_service

    engine = ["--model", str(model), "--load-format", "dummy", "--device", "cuda", "--max-total-tokens", "16384",
              "--kv-transport", transport, "--peer-fetch", "always", "--metrics-port", "-1"]
    procs = [start_service("worker", [*engine, "--worker-id", "a"], env={"CUDA_VISIBLE_DEVICES": "0,1"})]
    try:
        procs.append(start_service("worker", [*engine, "--worker-id", "b"], env={"CUDA_VISIBLE_DEVICES": "1,0"}))
        a, b = (worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(p.address)) for p in procs)
        prefix = [1, *range(1000, 3000)]
        params = sampling_pb2.SamplingParams(max_new_tokens=16, temperature=0.0)

        def generate(stub: worker_pb2_grpc.WorkerServiceStub, ids: list[int],
                     peer: worker_pb2.PeerPrefix | None = None) -> list[worker_pb2.GenerateResponse]:
            request = worker_pb2.GenerateRequest(token_ids=ids, sampling_params=params)
            if peer is not None:
                request.peer_prefix.CopyFrom(peer)
            return list(stub.Generate(request, timeout=300))

        generate(a, [*prefix, 7, 8])
        generate(b, [*prefix, 7, 8])  # b computes the same KV as a, and then reuses it from its own cache:
        computed = generate(b, [*prefix, 9, 10])  # the same kernels as after a fetch, so the same bits
        assert computed[-1].cached_tokens == len(prefix)
        assert b.FlushCache(worker_pb2.FlushCacheRequest(), timeout=60).flushed
        peer = worker_pb2.PeerPrefix(worker_id="a", address=procs[0].address, num_tokens=len(prefix))
        fetched = generate(b, [*prefix, 9, 10], peer)
        assert fetched[0].fetched_tokens == len(prefix) and fetched[-1].cached_tokens == len(prefix)
        assert [t for m in fetched for t in m.token_ids] == [t for m in computed for t in m.token_ids]
        load = b.GetLoad(worker_pb2.GetLoadRequest(), timeout=30)
        assert load.load.kv_used_tokens == 0 and load.disagg.num_reservations_active == 0
    finally:
        for proc in reversed(procs):
            proc.stop(30)
