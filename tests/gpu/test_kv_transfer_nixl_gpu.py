"""The nixl KV transport on two GPUs (needs the NIXL wheel, carried in .whl by scripts/nixl_gpu_wheel.sh):
`bench kv-transfer --transport nixl` between two processes in each mode, slot layout and KV dtype (the receiver's
KV checked bit for bit, beside a bare NIXL READ), the staged export waiting for its gather before the chunk
leaves, and a prefill and a decode worker that do not see each other's GPU: auto picks nixl, over UCX's default
transports and over TCP, and the tokens equal the grpc transport's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # as in test_kv_transfer_gpu: keep the CPU tests' interpreter

from radixmesh.cli import main
from radixmesh.engine.disagg.transport.nixl_lib import nixl_available
from radixmesh.protocol import worker_pb2
from tests.gpu.test_kv_transfer_gpu import _pd_tokens, _start_pd, model_8b  # noqa: F401 (a fixture)
from tests.integration.service_procs import ServiceProc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")]


def _two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


@pytest.mark.parametrize(("mode", "slots", "dtype"), [
    ("auto", "random", "bfloat16"), ("auto", "contiguous", "bfloat16"), ("direct", "random", "bfloat16"),
    ("staging", "random", "float8_e4m3fn")])
def test_bench_nixl_moves_the_kv_between_two_gpus(mode: str, slots: str, dtype: str, tmp_path: Path) -> None:
    _two_gpus()
    out = tmp_path / "kv-transfer.jsonl"
    sizes = ["1", "1000"] if mode == "direct" and slots == "random" else ["1", "1000", "4096"]  # per-row descriptors
    assert main(["bench", "kv-transfer", "--device", "cuda", "--transport", "nixl", "--mode", mode, "--slots", slots,
                 "--dtype", dtype, "--num-tokens", *sizes, "--repeats", "3", "--warmup", "2",
                 "--result-file", str(out)]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [str(r["num_tokens"]) for r in results] == sizes
    assert all(r["verified"] and r["mode"] == mode and r["bare_read_gbps"] > 0 for r in results)
    print({r["num_tokens"]: (r["total_ms_median"], r["bandwidth_ratio"], r["bare_ratio"]) for r in results})


def test_the_staged_export_is_gathered_before_its_chunk_leaves() -> None:
    """The gather runs behind ~0.5 s of GPU work; `ready_to_send` must hold the chunk until it ran, or the decode
    side READs a region not written yet (the READ does not wait on the prefill GPU's stream)."""
    from radixmesh.engine.disagg import bench_transfer_peer as peer
    from radixmesh.engine.disagg.transport.choice import decode_receiver_info

    _two_gpus()
    shape = (8192, 4, 8, 128, "bfloat16", "nixl", "staging")
    receiver = peer.Receiver(peer.PoolSpec("cuda:1", *shape))
    try:
        pool, transport = peer.open_side(peer.PoolSpec("cuda:0", *shape))
        peer.fill_random(pool, seed=0)
        slots = peer.random_slots(pool, 1000, seed=1)
        for i, sleep_cycles in enumerate((0, 1_000_000_000)):
            info = decode_receiver_info(receiver.request(peer.PrepareMsg(1000, seed=2)).transport_params)
            torch.cuda.synchronize()
            torch.cuda._sleep(sleep_cycles)
            transport.export(f"t{i}", slots, info)  # the gather is queued, not run
            chunks = transport.ready_to_send(f"t{i}")
            assert chunks is not None, "a nixl chunk is final in ready_to_send"
            receiver.send(peer.ChunkMsg(chunks[0], last=True))
            receiver.reply()
            transport.release(f"t{i}")
            assert receiver.request(peer.CheckMsg()).sums == peer.fingerprint(pool, slots), i
    finally:
        receiver.stop()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("ucx_tls", ["", "tcp,cuda_copy"])
def test_workers_on_gpus_they_do_not_share_pick_nixl_and_give_the_grpc_tokens(model_8b: list[str],  # noqa: F811
                                                                               ucx_tls: str) -> None:
    env = {"UCX_TLS": ucx_tls} if ucx_tls else {}
    runs: dict[str, tuple[list[list[int]], worker_pb2.DisaggStats]] = {}
    for transport in ("auto", "grpc"):
        procs: dict[str, ServiceProc] = _start_pd(model_8b, transport, gpus=("0", "1"), env=env)
        try:
            runs[transport] = _pd_tokens(procs)
        finally:
            for proc in reversed(list(procs.values())):
                proc.stop(30)
    (by_nixl, nixl_stats), (by_grpc, grpc_stats) = runs["auto"], runs["grpc"]
    assert by_nixl == by_grpc
    assert dict(nixl_stats.transfers_received_by_transport) == {"nixl": 3}, nixl_stats
    assert nixl_stats.kv_bytes_received == grpc_stats.kv_bytes_received > 0
    assert nixl_stats.num_fallbacks == 0
