"""The model runner's build steps that choose between paths: tensor-parallel checks and devices, where weights come
from, the memory plan with a draft model or other ranks, and the GPU-only steps' conditions (with stand-ins)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine import runner_build
from radixmesh.engine.distributed.sharding import TensorParallel
from radixmesh.engine.loader import PreparedModel
from radixmesh.engine.memory import TokenToKVPool
from radixmesh.engine.runner_build import (
    MemoryPlan,
    build_attention,
    build_graphs,
    build_multimodal,
    build_pools,
    check_tp_combination,
    check_tp_support,
    load_model,
    pick_device,
    plan_memory,
)
from radixmesh.engine.speculative.draft_setup import DraftMemory

from .scheduler_factory import tiny_model_config
from .test_runner_build import bare_runner, config

TP2 = TensorParallel(rank=1, size=2)


def prepared(load_format: str = "dummy") -> PreparedModel:
    return PreparedModel(model_path=None, config=tiny_model_config(), load_format=load_format, name="tiny",
                         tokenizer_path=None)


class MinComm:
    """Stands in for the group's collectives: the other rank has room for `other` tokens."""

    def __init__(self, other: int) -> None:
        self.other = other
        self.asked: list[int] = []

    def min_int(self, value: int) -> int:
        self.asked.append(value)
        return min(value, self.other)


# ---- tensor parallelism ----------------------------------------------------------------------------------
def test_without_tensor_parallelism_nothing_is_checked() -> None:
    check_tp_support(bare_runner(quant=object(), kv_dtype=torch.float16))  # FP8 alone is fine


@pytest.mark.parametrize(("quant", "kv_dtype"), [(object(), torch.float32), (None, torch.float16)])
def test_tensor_parallelism_checks_the_runners_quantization_and_kv_dtype(quant: object, kv_dtype: torch.dtype) -> None:
    check_tp_support(bare_runner(tp=TP2))
    with pytest.raises(RadixMeshError) as info:
        check_tp_support(bare_runner(tp=TP2, quant=quant, kv_dtype=kv_dtype))
    assert info.value.param == "tp_size" and "--tp-size 2" in info.value.message


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "qwen2_5_vl"])
def test_families_without_tensor_parallelism_are_named(family: str) -> None:
    with pytest.raises(RadixMeshError) as info:
        check_tp_combination(family, 2, False, False)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and repr(family) in info.value.message


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_text_families_run_with_tensor_parallelism(family: str) -> None:
    check_tp_combination(family, 8, False, False)


def test_each_rank_takes_the_cuda_device_of_its_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device(config(device="cuda"), bare_runner(tp=TP2)) == torch.device("cuda", 1)
    assert pick_device(config(device="cuda"), bare_runner()) == torch.device("cuda")
    assert pick_device(config(), bare_runner(tp=TP2)) == torch.device("cpu")  # CPU ranks share the CPU


# ---- the memory plan ---------------------------------------------------------------------------------------
def per_token(runner: Any) -> int:
    mc = runner.model_config
    return TokenToKVPool.bytes_per_token(mc.num_layers, runner.layout.num_kv_heads, mc.head_dim, runner.kv_dtype)


def test_every_rank_plans_the_smallest_pool_of_the_group() -> None:
    comm = MinComm(other=9)
    runner = bare_runner(config(max_total_tokens=100, max_running_requests=8), tp=TensorParallel(0, 2, comm))
    plan = plan_memory(runner)
    assert comm.asked == [100] and plan.max_total_tokens == 9 and plan.max_running_requests == 4
    roomy = plan_memory(bare_runner(config(max_total_tokens=100), tp=TensorParallel(0, 2, MinComm(other=500))))
    assert roomy.max_total_tokens == 100


def test_a_draft_models_kv_shares_each_token_of_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    pages = {"SC_AVPHYS_PAGES": 4000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(runner_build.os, "sysconf", lambda name: pages[name])
    runner = bare_runner(config(max_total_tokens=None, mem_fraction_static=0.5))
    alone = plan_memory(runner).max_total_tokens
    draft_kv = 3 * per_token(runner)
    monkeypatch.setattr(runner_build, "draft_memory_need", lambda cfg, dtype, target=None: DraftMemory(10**6, draft_kv))
    with_draft = plan_memory(runner).max_total_tokens
    ram = 4000 * 4096 * runner_build.CPU_KV_RAM_SHARE * 0.5
    assert alone == int(ram // per_token(runner)) and with_draft == int(ram // (4 * per_token(runner)))


def test_rows_are_capped_at_half_the_pool_but_never_below_one() -> None:
    assert plan_memory(bare_runner(config(max_total_tokens=2, max_running_requests=8))).max_running_requests == 1
    assert plan_memory(bare_runner(config(max_total_tokens=64, max_running_requests=8))).max_running_requests == 8
    with pytest.raises(RadixMeshError):
        plan_memory(bare_runner(config(max_total_tokens=1)))


# ---- weights -----------------------------------------------------------------------------------------------
class Recorder:
    """A quantization method or a weight source that logs what the build asks of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def prepare(self, model: torch.nn.Module) -> None:
        self.calls.append("prepare")

    def fill_dummy(self, model: torch.nn.Module, seed: int) -> None:
        self.calls.append(f"fill_dummy {seed}")

    def adapt_weights(self, model: torch.nn.Module, weights: Any) -> Any:
        self.calls.append("adapt")
        return [("adapted", w) for w in weights]

    def finish(self, model: torch.nn.Module) -> None:
        self.calls.append("finish")


class Loader(torch.nn.Module):
    """A model that only collects the weights it is given."""

    def __init__(self, got: list[Any]) -> None:
        super().__init__()
        self.got = got

    def load_weights(self, weights: Any) -> None:
        self.got.extend(weights)


def loaded_weights(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What the model's `load_weights` receives (the model class's loader replaced)."""
    got: list[Any] = []
    from radixmesh.engine.models.llama import CausalLM

    monkeypatch.setattr(CausalLM, "load_weights", lambda self, weights: got.extend(weights))
    return got


def test_dummy_weights_follow_the_seed_and_quantization_is_prepared_filled_and_finished() -> None:
    first = load_model(bare_runner(config(random_seed=3)), prepared())
    again = load_model(bare_runner(config(random_seed=3)), prepared())
    other = load_model(bare_runner(config(random_seed=4)), prepared())
    a, b, c = first.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a) and not all(torch.equal(a[k], c[k]) for k in a)
    assert not first.training
    quant = Recorder()
    load_model(bare_runner(config(random_seed=5), quant=quant), prepared())
    assert quant.calls == ["prepare", "fill_dummy 5", "finish"]


def test_a_checkpoint_goes_through_the_quantization_method(monkeypatch: pytest.MonkeyPatch) -> None:
    got = loaded_weights(monkeypatch)
    monkeypatch.setattr(runner_build, "iter_weights", lambda prep: iter([("w", 1), ("v", 2)]))
    monkeypatch.setattr(runner_build, "iter_weight_slices", lambda prep: pytest.fail("no TP here"))
    load_model(bare_runner(), prepared("safetensors"))
    assert got == [("w", 1), ("v", 2)]
    got.clear()
    quant = Recorder()
    load_model(bare_runner(quant=quant), prepared("safetensors"))
    assert got == [("adapted", ("w", 1)), ("adapted", ("v", 2))]
    assert quant.calls == ["prepare", "adapt", "finish"]


def test_a_tensor_parallel_rank_reads_only_its_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    got: list[Any] = []
    monkeypatch.setattr(runner_build, "iter_weights", lambda prep: pytest.fail("a rank reads slices"))
    monkeypatch.setattr(runner_build, "iter_weight_slices", lambda prep: iter([("slice", 0)]))
    runner_build._fill_weights(bare_runner(tp=TP2), Loader(got), prepared("safetensors"))
    assert got == [("slice", 0)]


def test_dummy_weights_under_tensor_parallelism_are_cut_from_one_whole_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixmesh.engine.distributed import dummy_weights

    asked: list[tuple[int, torch.device]] = []

    def whole(mc: Any, seed: int, device: torch.device, dtype: torch.dtype) -> Any:
        asked.append((seed, device))
        return iter([("whole", seed)])

    monkeypatch.setattr(dummy_weights, "iter_whole_dummy_weights", whole)
    monkeypatch.setattr(runner_build, "init_dummy_", lambda model, seed: pytest.fail("ranks must agree"))
    got: list[Any] = []
    runner_build._fill_weights(bare_runner(config(random_seed=7), tp=TP2), Loader(got), prepared())
    assert asked == [(7, torch.device("cpu"))] and got == [("whole", 7)]


def test_cpu_models_get_no_gpu_fast_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_build, "enable_gemv", lambda *a, **k: pytest.fail("GEMV kernels are CUDA only"))
    load_model(bare_runner(config(dtype="bfloat16"), dtype=torch.bfloat16), prepared())


# ---- pools, images, attention, graphs ---------------------------------------------------------------------
def test_under_tensor_parallelism_rank_0_journals_the_table_and_transports_see_every_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from radixmesh.engine.distributed import kv_pool

    monkeypatch.setattr(kv_pool, "ShardedKVPool", lambda pool, leader: ("sharded", pool, leader))
    leader = object()
    runner = bare_runner(plan=MemoryPlan(16, 2, 256), tp_leader=leader)
    build_pools(runner)
    assert runner.req_pool.journal == [] and runner.kv_transfer_pool == ("sharded", runner.kv_pool, leader)


def test_a_multimodal_model_gets_a_runtime_with_a_row_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_build, "MultimodalRuntime", lambda model, rows, device: (model, rows, device))
    model = object()
    runner = bare_runner(model=model, model_config=SimpleNamespace(is_multimodal=True),
                         req_pool=SimpleNamespace(size=5))
    assert build_multimodal(runner) == (model, 5, torch.device("cpu"))


class FakeBackend:
    supports_cuda_graph = True

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def enable_dense_prefill(self) -> None:
        self.calls.append("dense")

    def warm_up(self, pool: Any, num_heads: int, max_extend: int) -> None:
        self.calls.append(("warm_up", pool, num_heads, max_extend))


@pytest.mark.parametrize(("dense", "chunk", "expected"), [(False, 64, 64), (True, 1024, 256)])
def test_the_backend_is_warmed_up_to_the_longest_extend_it_will_see(monkeypatch: pytest.MonkeyPatch, dense: bool,
                                                                     chunk: int, expected: int) -> None:
    backend = FakeBackend()
    monkeypatch.setattr(runner_build, "create_backend", lambda name: backend)
    pool = object()
    runner = bare_runner(config(enable_dense_prefill=dense, chunked_prefill_size=chunk), kv_pool=pool)
    assert build_attention(runner) is backend
    assert backend.calls == [*(["dense"] if dense else []), ("warm_up", pool, runner.layout.num_heads, expected)]


def test_cuda_graphs_cover_at_most_the_rows_that_may_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_build, "CudaGraphRunner", lambda runner, max_bs: ("graphs", max_bs))
    runner = bare_runner(config(cuda_graph_max_bs=16), device=torch.device("cuda"), attn_backend=FakeBackend(),
                         plan=MemoryPlan(64, 6, 256))
    assert build_graphs(runner) == ("graphs", 6)
    runner.config = config(cuda_graph_max_bs=4)
    assert build_graphs(runner) == ("graphs", 4)
