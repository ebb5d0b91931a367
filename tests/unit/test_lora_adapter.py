"""Reading PEFT adapters: scaling, rsLoRA, and bad adapters refused naming the mismatch; slot sharding."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.lora.adapter import load_adapter
from radixmesh.engine.lora.layers import row_runs
from radixmesh.engine.model_config import ModelConfig
from radixmesh.wire.lora import adapter_namespace, namespaced, parse_lora_path, split_model_name, split_namespace

from .tp_factory import TINY_SHAPE

CONFIG = ModelConfig.from_hf_dict(TINY_SHAPE)  # hidden 64, 8 heads of 8, 2 KV heads, MLP 128, 2 layers


def write_adapter(path: Path, rank: int, hidden: int = 64, layers: int = 2, **cfg: object) -> Path:
    from safetensors.torch import save_file

    tensors = {}
    for i in range(layers):
        p = f"base_model.model.model.layers.{i}.self_attn."
        tensors[p + "q_proj.lora_A.weight"] = torch.randn(rank, hidden)
        tensors[p + "q_proj.lora_B.weight"] = torch.randn(64, rank)
        tensors[p + "v_proj.lora_A.weight"] = torch.randn(rank, hidden)
        tensors[p + "v_proj.lora_B.weight"] = torch.randn(16, rank)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 16, **cfg}))
    return path


def test_reads_rank_targets_and_scaling(tmp_path: Path) -> None:
    adapter = load_adapter("a", str(write_adapter(tmp_path / "a", 8)), CONFIG, 64)
    assert (adapter.rank, adapter.targets, adapter.scaling) == (8, ("q_proj", "v_proj"), 2.0)
    rs = load_adapter("b", str(write_adapter(tmp_path / "b", 16, use_rslora=True)), CONFIG, 64)
    assert rs.scaling == pytest.approx(16 / math.sqrt(16))


def test_rank_above_max_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RadixMeshError) as err:
        load_adapter("big", str(write_adapter(tmp_path / "a", 32)), CONFIG, 16)
    assert err.value.code is ErrorCode.INVALID_ARGUMENT and "rank 32" in err.value.message and "16" in err.value.message


def test_other_base_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RadixMeshError) as err:
        load_adapter("other", str(write_adapter(tmp_path / "a", 8, hidden=32)), CONFIG, 64)
    assert "another base model" in err.value.message and "(8, 64)" in err.value.message
    with pytest.raises(RadixMeshError, match="layer 2"):
        load_adapter("deep", str(write_adapter(tmp_path / "b", 8, layers=3)), CONFIG, 64)


def test_missing_files_and_other_peft_types(tmp_path: Path) -> None:
    with pytest.raises(RadixMeshError, match=r"no adapter_config\.json"):
        load_adapter("x", str(tmp_path), CONFIG, 64)
    path = write_adapter(tmp_path / "p", 8, peft_type="IA3")
    with pytest.raises(RadixMeshError, match="IA3"):
        load_adapter("p", str(path), CONFIG, 64)


def test_namespaces_and_names() -> None:
    ns = adapter_namespace("sql")
    assert ns != 0 and adapter_namespace(None) == 0 and adapter_namespace("sql") == ns != adapter_namespace("chat")
    keys = namespaced([1, 2, 3], ns)
    assert keys != [1, 2, 3] and split_namespace(keys) == (ns, [1, 2, 3]) and split_namespace([1, 2]) == (0, [1, 2])
    assert split_model_name("base:sql", ("base",)) == ("base", "sql")
    assert split_model_name("sql", ("base",)) == (None, "sql")
    assert split_model_name("base", ("base",)) == ("base", None)
    assert parse_lora_path("sql=/a/b") == ("sql", "/a/b") and parse_lora_path("/x/chat/") == ("chat", "/x/chat/")
    assert row_runs([-1, 2, 2, 0, -1, 0]) == [(2, 1, 3), (0, 3, 4), (0, 5, 6)]


def test_worker_load_carries_adapters_through_the_proto() -> None:
    from radixmesh.wire.load import WorkerLoad, load_from_proto, load_to_proto

    stats = {"num_running_reqs": 3, "lora_adapters": ["sql", "chat"], "lora_running": {"sql": 2},
             "lora_waiting": {"chat": 1}, "max_loras_per_batch": 8}
    load = WorkerLoad.from_stats(stats)
    assert load.lora_adapters == (("sql", 2, 0), ("chat", 0, 1)) and load.adapter_names == {"sql", "chat"}
    assert load_from_proto(load_to_proto(load)) == load
    assert load.as_stats()["lora_running"] == {"sql": 2} and "lora_adapters" not in WorkerLoad().as_stats()
