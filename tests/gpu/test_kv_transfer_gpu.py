"""KV gather/scatter and pull kernels at a real shape (Llama-3.1-8B KV: 32 layers, 8 KV heads, head dim 128, bf16);
`bench kv-transfer` between two processes on two GPUs in both cuda-ipc modes (the receiver's KV checked bit for
bit); and the cuda-ipc transport between a prefill and a decode worker process on two GPUs: random weights of the
Llama-3.1-8B shape speaking the default model's tokenizer (its files staged in RADIXMESH_TEST_TOKENIZER_DIR: the GPU
machine has no network), the same tokens as the grpc transport, and the faults (prefill worker stopped or killed
while it has the request) ending in a completed request and idle KV pools."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch

if not torch.cuda.is_available():
    # every test here is skipped then, but importing the kernels must not fix triton to compiled
    # mode before the CPU unit tests (which need the interpreter) import them
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from radixmesh.cli import main
from radixmesh.kernels.kv_transfer import gather_kv, make_kv_row_table, pull_kv_rows, scatter_kv
from radixmesh.kernels.kv_transfer_ref import gather_kv_torch
from radixmesh.protocol import common_pb2, router_pb2, router_pb2_grpc, sampling_pb2, worker_pb2
from tests.integration.service_procs import ServiceProc, start_service
from tests.integration.test_disaggregation import is_idle, load, metric, queued_on_prefill, start_in_thread, wait_for

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_tokens", [1, 1000, 4096])
def test_pull_at_llama_8b_shape(num_tokens: int, dtype: torch.dtype) -> None:
    """One launch moves every layer from one pool to another (here both on this GPU), bit for bit."""
    device = torch.device("cuda")
    layers, heads, dim = 32, 8, 128
    gen = torch.Generator(device=device).manual_seed(0)
    src_k = [torch.randn(8192, heads, dim, generator=gen, device=device).to(dtype) for _ in range(layers)]
    src_v = [torch.randn(8192, heads, dim, generator=gen, device=device).to(dtype) for _ in range(layers)]
    dst_k = [torch.zeros(6000, heads, dim, dtype=dtype, device=device) for _ in range(layers)]
    dst_v = [torch.zeros(6000, heads, dim, dtype=dtype, device=device) for _ in range(layers)]
    src_slots = torch.randperm(8191, device=device)[:num_tokens] + 1
    dst_slots = torch.randperm(5999, device=device)[:num_tokens] + 1
    table = make_kv_row_table(src_k, src_v, dst_k, dst_v)
    assert table.word_bytes == 8 and table.aligned
    pull_kv_rows(table, src_slots, dst_slots)
    torch.cuda.synchronize()
    untouched = torch.ones(6000, dtype=torch.bool, device=device)
    untouched[dst_slots] = False
    for layer in (0, 17, 31):
        for src, dst in ((src_k[layer], dst_k[layer]), (src_v[layer], dst_v[layer])):
            assert torch.equal(dst.view(torch.uint8)[dst_slots], src.view(torch.uint8)[src_slots])
            assert not dst.view(torch.uint8)[untouched].any()


# ---- bench kv-transfer: two processes on two GPUs ---------------------------------------------------
@pytest.mark.parametrize(("mode", "dtype"), [("direct", "bfloat16"), ("direct", "float8_e4m3fn"),
                                             ("staging", "bfloat16")])
def test_bench_kv_transfer_moves_the_kv_between_two_gpus(mode: str, dtype: str, tmp_path: Path) -> None:
    """The receiver's KV equals the sender's (the bench fails otherwise); direct mode maps the sender's pool in the
    receiving process and pulls over NVLink, or gathers on the sender's GPU without peer access."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "kv-transfer.jsonl"
    assert main(["bench", "kv-transfer", "--device", "cuda", "--mode", mode, "--dtype", dtype, "--num-tokens", "1",
                 "1000", "4096", "--repeats", "3", "--warmup", "2", "--result-file", str(out)]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["num_tokens"] for r in results] == [1, 1000, 4096]
    assert all(r["verified"] and r["mode"] == mode and r["num_chunks"] == 1 for r in results)
    print({r["num_tokens"]: (r["total_ms_median"], r["bandwidth_ratio"]) for r in results})


@pytest.mark.parametrize("mode", ["direct", "staging"])
def test_the_receiver_waits_for_the_senders_export(mode: str) -> None:
    """The sender's export is queued behind ~0.5 s of GPU work and its chunk sent at once: the receiving process
    must wait on the sender's IPC event (opened on its own GPU) before reading, or it reads an unwritten ring
    region (slot 0) and the KV differs."""
    from radixmesh.engine.disagg import bench_transfer_peer as peer

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    shape = (8192, 4, 8, 128, "bfloat16", "cuda-ipc")
    receiver = peer.Receiver(peer.PoolSpec("cuda:1", *shape))
    try:
        pool, transport = peer.open_side(peer.PoolSpec("cuda:0", *shape), mode=mode)
        peer.fill_random(pool, seed=0)
        slots = peer.random_slots(pool, 1000, seed=1)
        for i, sleep_cycles in enumerate((0, 1_000_000_000)):  # the first maps the pool and compiles the kernel
            receiver.request(peer.PrepareMsg(1000, seed=2))  # zeroes the receiver's pool
            torch.cuda.synchronize()
            torch.cuda._sleep(sleep_cycles)
            chunks = transport.export(f"t{i}", slots)  # not synchronized
            receiver.send(peer.ChunkMsg(chunks[0], last=True))
            receiver.reply()
            transport.release(f"t{i}")
            assert receiver.request(peer.CheckMsg()).sums == peer.fingerprint(pool, slots), i
    finally:
        receiver.stop()


# ---- two worker processes on two GPUs ------------------------------------------------------------
PD_PROMPTS = [[1, *range(1000, 1300)], [1, *range(5000, 5040)], [1, *range(20000, 20700)]]
FAULT_PROMPT_LEN = 12000  # long enough that the prefill worker still has it when the fault comes
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_8b(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Worker flags for random weights of the Llama-3.1-8B shape with the default model's tokenizer."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    staged = os.environ.get("RADIXMESH_TEST_TOKENIZER_DIR")
    if not staged:
        pytest.skip("RADIXMESH_TEST_TOKENIZER_DIR (the default model's tokenizer files) is not set")
    out = tmp_path_factory.mktemp("pd") / "llama-3.1-8b"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_tokenizer_model.py"), "llama-3.1-8b", staged,
                    str(out)], check=True, capture_output=True)
    return ["--model", str(out), "--load-format", "dummy", "--context-length", "16384"]


def _start_pd(model: list[str], transport: str, decode_args: tuple[str, ...] = (),
              gpus: tuple[str, str] = ("0,1", "1,0"), env: dict[str, str] | None = None) -> dict[str, ServiceProc]:
    """A prefill worker on GPU 0, a decode worker on GPU 1 (by default each sees both, its own first; `gpus`: what
    each sees; started together) and a router."""
    engine = [*model, "--device", "cuda", "--max-total-tokens", "40000", "--kv-transport", transport,
              "--metrics-port", "0", "--kv-lease-s", "60"]
    specs = {"prefill": ([*engine, "--role", "prefill", "--worker-id", "prefill-0"], gpus[0]),
             "decode": ([*engine, "--role", "decode", "--worker-id", "decode-0", *decode_args], gpus[1])}
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(start_service, "worker", args, env={**(env or {}), "CUDA_VISIBLE_DEVICES": seen})
                   for name, (args, seen) in specs.items()}
    procs: dict[str, ServiceProc] = {}
    errors = []
    for name, future in futures.items():
        try:
            procs[name] = future.result()
        except Exception as exc:  # the other one may have started: stop it below
            errors.append(exc)
    try:
        if errors:
            raise errors[0]
        procs["router"] = start_service("router", ["--workers", f"{procs['prefill'].address},{procs['decode'].address}",
                                                   "--pd-min-prefill-tokens", "1", "--health-interval-s", "0.3",
                                                   "--metrics-port", "-1"])
        router = router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(procs["router"].address))
        wait_for(lambda: _sees_both_roles(router), 60, "the router to see a prefill and a decode worker")
    except BaseException:
        for proc in reversed(list(procs.values())):
            proc.stop(30)
        raise
    return procs


def _pd_tokens(procs: dict[str, ServiceProc]) -> tuple[list[list[int]], worker_pb2.DisaggStats]:
    """Greedy tokens of PD_PROMPTS through the router of `procs` (prefill on GPU 0, decode on GPU 1), and the
    decode worker's counters."""
    router = router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(procs["router"].address))
    results = []
    for ids in PD_PROMPTS:
        params = sampling_pb2.SamplingParams(max_new_tokens=16, temperature=0.0)
        msgs = list(router.Generate(worker_pb2.GenerateRequest(token_ids=ids, sampling_params=params), timeout=300))
        assert msgs[0].routing.pd_reason == "prefill-tier", msgs[0].routing
        results.append([t for m in msgs for t in m.token_ids])
    return results, load(procs, "decode").disagg


def _sees_both_roles(router: router_pb2_grpc.RouterServiceStub) -> bool:
    reply = router.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
    return {w.role for w in reply.workers if w.healthy} == {common_pb2.WORKER_ROLE_PREFILL,
                                                              common_pb2.WORKER_ROLE_DECODE}


@pytest.fixture(scope="module")
def pd_ipc(model_8b: list[str]) -> Iterator[dict[str, ServiceProc]]:
    procs = _start_pd(model_8b, "cuda-ipc", ("--prefill-timeout-s", "4"))
    try:
        yield procs
    finally:
        for proc in reversed(list(procs.values())):
            proc.stop(30)


@pytest.mark.integration
@pytest.mark.slow
def test_cuda_ipc_between_two_gpus_gives_the_grpc_tokens(model_8b: list[str], pd_ipc: dict[str, ServiceProc]) -> None:
    by_ipc, ipc_stats = _pd_tokens(pd_ipc)
    procs = _start_pd(model_8b, "grpc")
    try:
        by_grpc, grpc_stats = _pd_tokens(procs)
    finally:
        for proc in reversed(list(procs.values())):
            proc.stop(30)
    assert by_ipc == by_grpc
    for stats in (grpc_stats, ipc_stats):
        assert stats.num_committed == len(PD_PROMPTS) and stats.num_fallbacks == 0, stats
    assert ipc_stats.kv_bytes_received == grpc_stats.kv_bytes_received > 0  # the same KV, moved GPU to GPU


# ---- faults on the GPUs: the request completes (the decode worker computes the prompt), both pools go idle ----
def _fault_ids(seed: int) -> list[int]:
    return [1] + [300 + (i * 71 + seed * 977) % 40000 for i in range(FAULT_PROMPT_LEN - 1)]


def _answer_despite(procs: dict[str, ServiceProc], seed: int,
                    fault: Callable[[], object]) -> list[worker_pb2.GenerateResponse]:
    """Tokens of a long prompt whose prefill worker suffers `fault` once it has the request; the decode worker
    must have fallen back to computing the prompt itself exactly once."""
    fallbacks = load(procs, "decode").disagg.num_fallbacks
    params = sampling_pb2.SamplingParams(max_new_tokens=8, temperature=0.0)
    _, result, thread = start_in_thread(procs, _fault_ids(seed), params)
    wait_for(lambda: queued_on_prefill(procs) > 0, 60, "the prefill worker to have the request")
    fault()
    thread.join(180)
    assert "msgs" in result, result
    assert load(procs, "decode").disagg.num_fallbacks == fallbacks + 1
    msgs: list[worker_pb2.GenerateResponse] = result["msgs"]
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len([t for m in msgs for t in m.token_ids]) == 8
    return msgs


@pytest.mark.integration
@pytest.mark.slow
def test_prefill_worker_stopped_the_transfer_times_out_and_the_request_completes(
        pd_ipc: dict[str, ServiceProc]) -> None:
    prefill = pd_ipc["prefill"].proc
    try:
        _answer_despite(pd_ipc, 1, lambda: prefill.send_signal(signal.SIGSTOP))
    finally:
        prefill.send_signal(signal.SIGCONT)
    assert metric(pd_ipc["decode"], "radixmesh_kv_transfer_fallbacks_total", reason="prefill_timeout") == 1
    wait_for(lambda: is_idle(pd_ipc, "prefill") and is_idle(pd_ipc, "decode"), 60, "both KV pools empty")


@pytest.mark.integration
@pytest.mark.slow
def test_prefill_worker_killed_the_request_completes(pd_ipc: dict[str, ServiceProc]) -> None:
    _answer_despite(pd_ipc, 2, pd_ipc["prefill"].proc.kill)
    assert metric(pd_ipc["decode"], "radixmesh_kv_transfer_fallbacks_total", reason="prefill_unavailable") == 1
    wait_for(lambda: is_idle(pd_ipc, "decode"), 60, "the decode worker's KV pool empty")
