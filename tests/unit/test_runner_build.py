"""The model runner's build steps (engine/runner_build.py), each on its own where it can be, and in order on CPU."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine import runner_build
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.distributed.layout import ShardLayout
from radixmesh.engine.distributed.sharding import TP_NONE
from radixmesh.engine.loader import PreparedModel
from radixmesh.engine.memory import TokenToKVPool
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.engine.runner_build import (
    DTYPES,
    MemoryPlan,
    build_attention,
    build_graphs,
    build_multimodal,
    build_pools,
    check_tp_combination,
    pick_device,
    plan_memory,
    set_fp8_kv_scales,
)

from .scheduler_factory import tiny_model_config


def config(**overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = dict(device="cpu", dtype="float32", max_total_tokens=128, max_running_requests=4,
                                    load_format="dummy")
    settings.update(overrides)
    return EngineConfig(**settings).resolve()


def bare_runner(cfg: EngineConfig | None = None, **attrs: Any) -> Any:
    """What the steps read of a runner, before its build: config, model config, rank, layout."""
    cfg = cfg or config()
    mc = tiny_model_config()
    runner = SimpleNamespace(config=cfg, model_config=mc, tp=TP_NONE, rank_link=None, tp_leader=None,
                             layout=ShardLayout.of(mc, 0, 1), device=torch.device("cpu"), dtype=torch.float32,
                             kv_dtype=torch.float32, context_len=mc.context_len, quant=None)
    for name, value in attrs.items():
        setattr(runner, name, value)
    return runner


def test_the_device_is_checked_before_anything_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pick_device(config(), bare_runner()) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RadixMeshError) as info:
        pick_device(config(device="cuda"), bare_runner())
    assert info.value.param == "device" and "no CUDA device" in info.value.message


def test_tensor_parallelism_refuses_fp8_weights_and_kv() -> None:
    check_tp_combination("llama", 2, False, False)
    for fp8_weights, fp8_kv in ((True, False), (False, True)):
        with pytest.raises(RadixMeshError) as info:
            check_tp_combination("qwen2", 4, fp8_weights, fp8_kv)
        assert info.value.code is ErrorCode.INVALID_ARGUMENT and "--tp-size 4" in info.value.message


def test_the_memory_plan_takes_the_given_size_and_caps_the_rows() -> None:
    plan = plan_memory(bare_runner(config(max_total_tokens=10, max_running_requests=32)))
    assert plan == MemoryPlan(max_total_tokens=10, max_running_requests=5, context_len=256)


def test_the_memory_plan_on_cpu_is_a_share_of_free_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    pages = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(runner_build.os, "sysconf", lambda name: pages[name])
    runner = bare_runner(config(max_total_tokens=None, mem_fraction_static=0.5))
    mc = runner.model_config
    per_token = TokenToKVPool.bytes_per_token(mc.num_layers, runner.layout.num_kv_heads, mc.head_dim, torch.float32)
    plan = plan_memory(runner)
    assert plan.max_total_tokens == int(1000 * 4096 * runner_build.CPU_KV_RAM_SHARE * 0.5 // per_token)


def test_too_little_memory_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_build.os, "sysconf", lambda name: 1)  # one byte of free RAM
    with pytest.raises(RadixMeshError) as info:
        plan_memory(bare_runner(config(max_total_tokens=None)))
    assert info.value.param == "mem_fraction_static" and "not enough memory" in info.value.message


def test_pools_follow_the_plan() -> None:
    runner = bare_runner(plan=MemoryPlan(32, 3, 256))
    build_pools(runner)
    assert runner.req_pool.size == 4 and runner.kv_pool.size == 32 and runner.allocator.size == 32
    assert runner.kv_transfer_pool is runner.kv_pool  # no TP: transports read this rank's pool
    assert runner.kv_pool.num_layers == runner.model_config.num_layers


def test_fp8_scales_reach_only_an_fp8_pool() -> None:
    calls: list[str] = []
    quant = SimpleNamespace(kv_scales=lambda: calls.append("scales") or {})
    runner = bare_runner(quant=quant, kv_pool=SimpleNamespace(is_fp8=False))
    set_fp8_kv_scales(runner)
    assert calls == []
    runner.kv_pool = SimpleNamespace(is_fp8=True, set_scales=lambda scales: calls.append(f"set {scales}"))
    set_fp8_kv_scales(runner)
    assert calls == ["scales", "set {}"]


def test_text_models_get_no_multimodal_runtime_and_cpu_no_graphs() -> None:
    runner = bare_runner(attn_backend=SimpleNamespace(supports_cuda_graph=True), plan=MemoryPlan(32, 3, 256))
    assert build_multimodal(runner) is None
    assert build_graphs(runner) is None  # CPU
    runner.device = torch.device("cuda")
    runner.config = config(disable_cuda_graph=True)
    assert build_graphs(runner) is None  # disabled
    runner.config = config()
    runner.attn_backend = SimpleNamespace(supports_cuda_graph=False)
    assert build_graphs(runner) is None  # the backend cannot replay them


def test_the_attention_backend_is_built_and_warmed_for_this_pool() -> None:
    runner = bare_runner(plan=MemoryPlan(32, 3, 256))
    build_pools(runner)
    backend = build_attention(runner)
    assert type(backend).__name__ == "TorchNativeBackend"  # what "auto" resolves to on CPU


def test_the_steps_run_in_order_and_fill_the_runner() -> None:
    prepared = PreparedModel(model_path=None, config=tiny_model_config(), load_format="dummy", name="tiny",
                             tokenizer_path=None)
    runner = ModelRunner(config(), prepared)
    assert runner.device == torch.device("cpu") and runner.dtype is DTYPES["float32"]
    assert runner.quant is None and runner.kv_dtype == torch.float32 and runner.mm is None
    assert runner.plan.max_total_tokens == 128 and runner.kv_pool.size == 128 and runner.allocator.size == 128
    assert runner.graph_runner is None and runner.last_tokens is None and runner.context_len == 256
    assert all(not p.is_meta for p in runner.model.parameters())  # every parameter filled


def test_a_failing_step_closes_the_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    prepared = PreparedModel(model_path=None, config=tiny_model_config(), load_format="dummy", name="tiny",
                             tokenizer_path=None)
    closed: list[bool] = []
    monkeypatch.setattr(ModelRunner, "close", lambda self: closed.append(True))
    monkeypatch.setattr(runner_build, "plan_memory", lambda runner: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        ModelRunner(config(), prepared)
    assert closed == [True]
