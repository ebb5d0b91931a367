"""`radixmesh bench kv-transfer` on the CPU at a tiny KV shape: the grpc transport between this process and a
spawned receiver, one verified JSON line per size; a receiver holding other KV fails the command."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from radixmesh.cli import main
from radixmesh.engine.disagg import bench_transfer as bench
from radixmesh.engine.disagg import bench_transfer_peer as peer
from radixmesh.engine.disagg.transport.nixl_lib import nixl_available
from radixmesh.engine.memory import TokenToKVPool

TINY = ["--num-layers", "2", "--kv-heads", "2", "--head-dim", "8", "--dtype", "bfloat16"]


def test_the_command_moves_kv_between_two_processes_and_reports_json_lines(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "kv-transfer.jsonl"
    assert main(["bench", "kv-transfer", "--device", "cpu", *TINY, "--num-tokens", "64", "256", "--repeats", "2",
                 "--warmup", "1", "--result-file", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["num_tokens"] for r in lines] == [64, 256]
    for r in lines:
        assert r["bench"] == "kv-transfer" and r["transport"] == "grpc" and r["device"] == "cpu"
        assert r["mode"] is None  # --mode is cuda-ipc's
        assert r["num_bytes"] == r["num_tokens"] * 2 * 2 * 2 * 8 * 2  # tokens x layers x (K, V) x heads x dim x 2 B
        assert r["verified"] is True and r["num_chunks"] == 1 and r["repeats"] == 2
        for phase in ("export", "handoff", "receive", "total", "copy"):
            assert 0 < r[f"{phase}_ms_min"] <= r[f"{phase}_ms_median"], phase
        assert r["total_ms_median"] >= r["export_ms_median"]
        assert r["transfer_gbps"] > 0 and r["copy_gbps"] > 0 and r["bandwidth_ratio"] > 0
        assert r["command"] and r["torch"] == torch.__version__ and r["sender_device_name"]
    table = capsys.readouterr().out
    assert "kv-transfer over grpc" in table and "copy GB/s" in table and "     256" in table


@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (radixmesh[nixl])")
@pytest.mark.parametrize("slots", ["random", "contiguous"])
def test_nixl_moves_kv_between_two_processes_beside_a_bare_nixl_read(tmp_path: Path, slots: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "kv-transfer.jsonl"
    assert main(["bench", "kv-transfer", "--device", "cpu", "--transport", "nixl", *TINY, "--num-tokens", "64",
                 "--repeats", "2", "--warmup", "1", "--slots", slots, "--result-file", str(out)]) == 0
    (r,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert r["transport"] == "nixl" and r["mode"] == "auto" and r["slots"] == slots and r["verified"] is True
    assert r["bare_read_gbps"] > 0 and r["bare_ratio"] == round(r["transfer_gbps"] / r["bare_read_gbps"], 4)
    stats = r["transport_stats"]  # 64 rows of 32 B: too fragmented for descriptors either way, so staged
    assert stats["nixl_exports_staged"] == 3 and stats["nixl_metadata_sent"] == 1 and stats["nixl_staging_regions"] == 0
    assert "bare GB/s" in capsys.readouterr().out


def test_a_mode_of_another_transport_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "kv-transfer", "--device", "cpu", "--transport", "cuda-ipc", "--mode", "auto", *TINY]) == 2
    assert "not one of cuda-ipc's" in capsys.readouterr().err


def test_cuda_ipc_on_the_cpu_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "kv-transfer", "--device", "cpu", "--transport", "cuda-ipc", *TINY]) == 2
    assert "cuda-ipc" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has two GPUs")
def test_cuda_without_two_gpus_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "kv-transfer", "--device", "cuda", *TINY]) == 2
    assert "needs two GPUs" in capsys.readouterr().err


def test_the_fingerprint_sees_the_order_of_slots() -> None:
    pool, _ = peer.open_side(peer.PoolSpec("cpu", 32, 2, 2, 8, "bfloat16", "grpc"))
    peer.fill_random(pool, seed=0)
    slots = peer.random_slots(pool, 16, seed=1)
    assert slots.unique().numel() == 16 and int(slots.min()) >= 1
    assert peer.fingerprint(pool, slots) == peer.fingerprint(pool, slots.clone())
    assert peer.fingerprint(pool, slots) != peer.fingerprint(pool, slots.flip(0))


class _LosingReceiver:
    """Replies like a receiver whose pool never got the KV."""

    def __init__(self, pool: TokenToKVPool) -> None:
        self.pool = pool

    def send(self, msg: object) -> None:
        pass

    def reply(self) -> peer.ReplyMsg:
        return peer.ReplyMsg(receive_s=1e-4)

    def request(self, msg: object) -> peer.ReplyMsg:
        if isinstance(msg, peer.CheckMsg):
            return peer.ReplyMsg(sums=peer.fingerprint(self.pool, peer.random_slots(self.pool, 8, seed=5)))
        return peer.ReplyMsg()


def test_kv_that_did_not_arrive_fails_the_benchmark() -> None:
    pool, transport = peer.open_side(peer.PoolSpec("cpu", 32, 2, 2, 8, "bfloat16", "grpc"))
    peer.fill_random(pool, seed=0)
    args = argparse.Namespace(seed=0, warmup=0, repeats=1)
    with pytest.raises(bench.KVMismatchError, match="differs from the sender's"):
        bench._measure(args, bench._Sides(pool, transport, _LosingReceiver(pool), "cpu"), 8)
