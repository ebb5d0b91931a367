"""`radixmesh cluster up --gpus`: which GPUs each worker sees, in which order; no GPU needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixmesh.cli import build_parser
from radixmesh.cluster import local
from radixmesh.cluster.local import ClusterSpec, ClusterState, resolve_gpus, visible_gpu_ids
from radixmesh.cluster.spec import parse_gpu_ids, place_workers
from radixmesh.common.errors import RadixMeshError


def test_each_worker_sees_every_gpu_its_own_first() -> None:
    assert place_workers(["0", "1"], [1, 1]) == [["0", "1"], ["1", "0"]]
    assert place_workers(["0", "1", "2", "3"], [1, 1, 1]) == [["0", "1", "2", "3"], ["1", "2", "3", "0"],
                                                               ["2", "3", "0", "1"]]
    assert place_workers(["GPU-a"], [1]) == [["GPU-a"]]


def test_tensor_parallel_workers_take_consecutive_gpus() -> None:
    assert place_workers(["0", "1", "2", "3"], [2, 2]) == [["0", "1", "2", "3"], ["2", "3", "0", "1"]]
    assert place_workers(["4", "5", "6"], [2, 2]) == [["4", "5", "6"], ["6", "4", "5"]]  # the second wraps round
    with pytest.raises(RadixMeshError, match="needs 4 GPUs; 2 selected"):
        place_workers(["0", "1"], [4])


def test_more_workers_than_gpus_share_round_robin() -> None:
    assert place_workers(["0", "1"], [1, 1, 1]) == [["0", "1"], ["1", "0"], ["0", "1"]]


def test_gpu_lists() -> None:
    assert parse_gpu_ids("0,1") == ["0", "1"] and parse_gpu_ids(" 1 , 0 ") == ["1", "0"]
    for bad in ("", "0,,1", "0,0"):
        with pytest.raises(RadixMeshError, match="--gpus"):
            parse_gpu_ids(bad)
    with pytest.raises(RadixMeshError, match="--gpus"):
        ClusterSpec(gpus="0,0")
    assert visible_gpu_ids("2,3") == ["2", "3"]
    assert visible_gpu_ids("") == [] and visible_gpu_ids("-1") == []
    assert visible_gpu_ids("1,-1,0") == ["1"]  # CUDA stops at the first invalid entry


def test_auto_places_workers_on_cuda_and_leaves_cpu_workers_alone() -> None:
    pd = ClusterSpec(num_workers=0, num_prefill_workers=1, num_decode_workers=1).with_gpus(["0", "1"])
    assert pd.gpus == "0,1"
    assert pd.worker_gpus() == {"prefill-0": ["0", "1"], "decode-0": ["1", "0"]}
    assert ClusterSpec(worker_args="--device=cuda").with_gpus(["0", "1"]).worker_gpus() == {
        "worker-0": ["0", "1"], "worker-1": ["1", "0"]}
    assert ClusterSpec(worker_args="--device cpu").with_gpus(["0", "1"]).gpus == "none"
    assert ClusterSpec().with_gpus([]).worker_gpus() == {}  # no GPU on this host
    assert ClusterSpec(gpus="none").with_gpus(["0", "1"]).worker_gpus() == {}
    assert ClusterSpec(gpus="1").with_gpus(["0", "1"]).worker_gpus() == {"worker-0": ["1"], "worker-1": ["1"]}
    assert ClusterSpec(gpus="0,1", worker_args="--device cpu").worker_gpus() == {}


def test_tp_size_of_the_worker_args() -> None:
    spec = ClusterSpec(num_workers=2, gpus="0,1,2,3", worker_args="--max-total-tokens 8192 --tp-size 2")
    assert spec.worker_tp_size() == 2
    assert spec.worker_gpus() == {"worker-0": ["0", "1", "2", "3"], "worker-1": ["2", "3", "0", "1"]}
    assert ClusterSpec(worker_args="--tp-size=4 --tp-size 1").worker_tp_size() == 1  # the last one wins
    with pytest.raises(RadixMeshError, match="--tp-size"):
        ClusterSpec(worker_args="--tp-size two").worker_tp_size()


def test_moe_workers_spread_their_experts_over_their_own_gpus() -> None:
    assert ClusterSpec(worker_args="--tp-size 2 --ep-size 2").worker_tp_size() == 2
    assert ClusterSpec(worker_args="--tp-size 2 --ep-size=1").worker_tp_size() == 2
    with pytest.raises(RadixMeshError, match="EP size = GPUs per worker") as info:
        ClusterSpec(worker_args="--ep-size 2").worker_tp_size()
    assert info.value.param == "ep_size" and "--tp-size 2" in info.value.message


def test_auto_reads_the_parents_visible_devices_before_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "_count_nvidia_gpus", lambda: 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert resolve_gpus(ClusterSpec()).gpus == "3,5"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert resolve_gpus(ClusterSpec(num_workers=1)).gpus == "0,1,2,3,4,5,6,7"
    assert resolve_gpus(ClusterSpec(gpus="none")).gpus == "none"


def test_cli_prints_the_placement_and_warns_when_workers_share(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    specs: list[ClusterSpec] = []

    def fake_up(spec: ClusterSpec) -> None:
        specs.append(spec)
        raise RadixMeshError(local.ErrorCode.UNAVAILABLE, "not starting anything in a unit test")

    monkeypatch.setattr(local, "cluster_up", fake_up)
    monkeypatch.setattr(local, "detect_gpus", lambda: ["0", "1"])
    args = build_parser().parse_args(["cluster", "up", "--prefill-workers", "1", "--decode-workers", "1"])
    with pytest.raises(RadixMeshError):
        args.func(args)
    assert specs.pop().gpus == "0,1"
    out, err = capsys.readouterr()
    assert out.splitlines() == ["radixmesh cluster: prefill-0 on GPU 0 (CUDA_VISIBLE_DEVICES=0,1)",
                                "radixmesh cluster: decode-0 on GPU 1 (CUDA_VISIBLE_DEVICES=1,0)"]
    assert not err
    args = build_parser().parse_args(["cluster", "up", "--workers", "3", "--gpus", "0,1"])
    with pytest.raises(RadixMeshError):
        args.func(args)
    out, err = capsys.readouterr()
    assert out.splitlines()[2] == "radixmesh cluster: worker-2 on GPU 0 (CUDA_VISIBLE_DEVICES=0,1)"
    assert "3 workers need 3 GPUs, 2 selected" in err


def test_state_records_the_placement_and_reads_older_files(tmp_path: Path) -> None:
    state = ClusterState(gateway_url="http://x", router_address="r", tokenizer_address="t", worker_addresses=[],
                         redis_url=None, policy="cache-aware", log_dir="logs", worker_gpus={"worker-0": "1,0"})
    state.save(tmp_path)
    assert json.loads((tmp_path / "state.json").read_text())["worker_gpus"] == {"worker-0": "1,0"}
    loaded = ClusterState.load(tmp_path)
    assert loaded is not None and loaded.worker_gpus == {"worker-0": "1,0"}
    data = json.loads((tmp_path / "state.json").read_text())
    del data["worker_gpus"]
    (tmp_path / "state.json").write_text(json.dumps(data))
    older = ClusterState.load(tmp_path)
    assert older is not None and older.worker_gpus == {}


def test_worker_env_sets_the_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert local._worker_env(2, ["1", "0"]) == {"CUDA_VISIBLE_DEVICES": "1,0"}
    assert local._worker_env(2, None) == {}
