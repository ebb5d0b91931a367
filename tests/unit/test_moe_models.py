"""Qwen3, Qwen3-MoE and Mixtral on the CPU: transformers' greedy tokens, expert layouts across ranks, loading,
random weights for tensor-parallel ranks, FP8 experts and the expert-load counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from safetensors.torch import load_file, save_file

from radixmesh.common.errors import RadixMeshError
from radixmesh.common.moe_metrics import MoeStatsCollector
from radixmesh.engine.distributed.dummy_weights import iter_whole_dummy_weights
from radixmesh.engine.distributed.layout import check_tensor_parallel
from radixmesh.engine.distributed.sharding import TensorParallel
from radixmesh.engine.loader import iter_weight_slices, iter_weights, prepare_model
from radixmesh.engine.loader.dummy import init_dummy_, named_shape_config
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.moe import FusedExperts, SparseMoeBlock
from radixmesh.engine.models.moe_decoder import MoeCausalLM
from radixmesh.engine.models.moe_spec import ExpertLayout, MoeSpec, check_experts, moe_spec
from radixmesh.engine.quant.accuracy import compare_fp8, random_prompts
from radixmesh.engine.request import Req
from radixmesh.wire.sampling import SamplingParams

from .fp8_factory import E4M3, make_runner
from .moe_factory import PROMPTS, hf_greedy, write_hf_checkpoint
from .scheduler_factory import run_until_idle
from .tp_factory import make_tp_scheduler


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("moe")
    return {kind: write_hf_checkpoint(kind, root / kind) for kind in ("qwen3", "qwen3_moe", "qwen3_moe_step2",
                                                                      "mixtral")}


def greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, **overrides: Any) -> list[list[int]]:
    sched, col = make_tp_scheduler(model_dir, 1, **overrides)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        sched.add_request(Req(rid=f"r{i}", origin_input_ids=list(prompt), params=params))
    run_until_idle(sched)
    assert not col.errors, col.errors
    return [col.tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "qwen3_moe_step2", "mixtral"])
def test_tiny_models_match_transformers_greedy(checkpoints: dict[str, tuple[Path, Any]], kind: str) -> None:
    path, hf = checkpoints[kind]
    want = hf_greedy(hf, PROMPTS, 10)
    assert greedy(path, PROMPTS, 10, chunked_prefill_size=8) == want  # prompts in chunks, decode batched


def test_moe_facts_of_config_json(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    specs = {kind: moe_spec(ModelConfig.from_dir(path)) for kind, (path, _) in checkpoints.items()}
    assert specs["qwen3"] is None
    assert specs["qwen3_moe"] == MoeSpec(8, 3, 16, True, frozenset({0, 2}))
    assert specs["qwen3_moe_step2"] == MoeSpec(6, 2, 16, False, frozenset({1}))
    assert specs["mixtral"] == MoeSpec(4, 2, 24, True, frozenset({0, 1, 2}))
    assert ModelConfig.from_dir(checkpoints["qwen3_moe"][0]).qk_norm


def test_published_shapes() -> None:
    qwen, mixtral = named_shape_config("qwen3-30b-a3b"), named_shape_config("mixtral-8x7b")
    assert moe_spec(qwen) == MoeSpec(128, 8, 768, True, frozenset(range(48)))
    assert moe_spec(mixtral) == MoeSpec(8, 2, 14336, True, frozenset(range(32)))
    assert qwen.qk_norm and not mixtral.qk_norm and named_shape_config("qwen3-8b").qk_norm
    for config in (qwen, mixtral):
        check_tensor_parallel(config, 2, 2)
        check_tensor_parallel(config, 2, 1)


@pytest.mark.parametrize(("rank", "tp", "ep", "want"), [
    (1, 2, 2, (4, 4, 0, 16, 1)),    # experts 4..7, whole width
    (1, 2, 1, (0, 8, 8, 8, 0)),     # every expert, columns 8..15
    (0, 1, 1, (0, 8, 0, 16, 0)),
])
def test_expert_layouts(rank: int, tp: int, ep: int, want: tuple[int, ...]) -> None:
    lay = ExpertLayout.of(MoeSpec(8, 2, 16, True, frozenset({0})), rank, tp, ep)
    assert (lay.expert_start, lay.num_local, lay.inter_begin, lay.inter_local, lay.ep_rank) == want
    assert lay.is_local(lay.expert_start) and not lay.is_local(lay.expert_start + lay.num_local)


@pytest.mark.parametrize(("model", "tp", "ep", "words"), [
    ("qwen3-30b-a3b", 3, 3, ["128 experts", "--ep-size 3"]),
    ("mixtral-8x7b", 4, 2, ["--ep-size 2", "--ep-size 4"]),
    ("qwen3-8b", 2, 2, ["--ep-size 2", "no experts"]),
    ("qwen3-30b-a3b", 5, 1, ["768", "--tp-size 5"]),
])
def test_splits_that_do_not_fit_get_a_clear_error(model: str, tp: int, ep: int, words: list[str]) -> None:
    with pytest.raises(RadixMeshError) as info:
        check_experts(named_shape_config(model), tp, ep)  # the experts' arithmetic (the heads' is ShardLayout's)
    assert info.value.param in ("ep_size", "tp_size")
    for word in words:
        assert word in info.value.message, info.value.message


def _build(config: ModelConfig, rank: int = 0, size: int = 1, ep: int = 1) -> MoeCausalLM:
    with torch.device("meta"):
        model = MoeCausalLM(config, TensorParallel(rank, size, ep_size=ep))
    model = model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers()
    return model


def _check_experts(whole: MoeCausalLM, ranks: list[MoeCausalLM]) -> None:
    """Each rank's experts are its cut of the whole model's (and the rest of each rank loaded too)."""
    for i, layer in enumerate(whole.model.layers):
        if not isinstance(layer.mlp, SparseMoeBlock):
            continue
        w13, w2 = layer.mlp.experts.w13, layer.mlp.experts.w2
        for model in ranks:
            block = model.model.layers[i].mlp
            lay, inter = block.layout, w2.shape[2]
            experts = slice(lay.expert_start, lay.expert_start + lay.num_local)
            cols = slice(lay.inter_begin, lay.inter_begin + lay.inter_local)
            gate, up = w13[experts, :inter][:, cols], w13[experts, inter:][:, cols]
            assert torch.equal(block.experts.w13, torch.cat([gate, up], dim=1)), f"layer {i} w13"
            assert torch.equal(block.experts.w2, w2[experts][:, :, cols]), f"layer {i} w2"
            assert torch.equal(block.gate.weight, layer.mlp.gate.weight)


@pytest.mark.parametrize(("kind", "ep"), [("qwen3_moe", 2), ("qwen3_moe", 1), ("mixtral", 2)])
def test_each_rank_reads_its_experts(checkpoints: dict[str, tuple[Path, Any]], kind: str, ep: int) -> None:
    prepared = prepare_model(str(checkpoints[kind][0]), progress=False)
    whole = _build(prepared.config)
    whole.load_weights(iter_weights(prepared, progress=False))
    ranks = []
    for rank in range(2):
        model = _build(prepared.config, rank, 2, ep)
        model.load_weights(iter_weight_slices(prepared, progress=False))
        ranks.append(model)
    _check_experts(whole, ranks)


def test_random_weights_of_a_rank_are_the_whole_model_cut(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    config = ModelConfig.from_dir(checkpoints["qwen3_moe"][0])
    whole = _build(config)
    init_dummy_(whole, seed=3)
    ranks = []
    for rank in range(2):
        model = _build(config, rank, 2, 2)
        model.load_weights(iter_whole_dummy_weights(config, 3, torch.device("cpu"), torch.float32))
        ranks.append(model)
    _check_experts(whole, ranks)


def test_missing_and_misplaced_expert_weights_are_named(checkpoints: dict[str, tuple[Path, Any]],
                                                        tmp_path: Path) -> None:
    src = checkpoints["qwen3_moe"][0]
    tensors = load_file(str(src / "model.safetensors"))
    config = ModelConfig.from_dir(src)
    cases = {"model.layers.2.mlp.experts.5.up_proj.weight": "layer 2, e.g. expert 5 up",
             "model.layers.1.mlp.experts.0.up_proj.weight": "layer 1, a dense layer",
             "model.layers.0.mlp.experts.9.up_proj.weight": "expert 9; the model has 8"}
    for name, words in cases.items():
        broken = dict(tensors)
        if name in broken:
            del broken[name]
        else:
            broken[name] = torch.zeros(16, 32)
        save_file(broken, str(tmp_path / "model.safetensors"))
        model = _build(config)
        with pytest.raises(ValueError, match=words.replace(";", ".")):
            model.load_weights(
                (n, t) for n, t in load_file(str(tmp_path / "model.safetensors")).items())


def test_fp8_experts_track_the_float32_model(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    config = ModelConfig.from_dir(checkpoints["qwen3_moe"][0])
    ref = make_runner(config, max_total_tokens=2048)
    fp8 = make_runner(config, max_total_tokens=2048, quantization="fp8")
    experts = fp8.model.model.layers[0].mlp.experts
    assert isinstance(experts, FusedExperts) and experts.w13.dtype == E4M3 and experts.w2_scale is not None
    assert fp8.model.model.layers[0].mlp.gate.weight.dtype == torch.float32  # the router stays unquantized
    assert fp8.memory_info()["fp8_expert_layers"] == 2
    result = compare_fp8(ref, fp8, random_prompts(24, config.vocab_size, 4, 40, seed=1))
    assert result["cosine_mean"] >= 0.99 and result["cosine_min"] >= 0.97, result


def test_fp8_experts_load_a_checkpoint_and_serve(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    path, hf = checkpoints["mixtral"]
    runner = make_runner(str(path), quantization="fp8")
    experts = runner.model.model.layers[1].mlp.experts
    hf_experts = hf.model.layers[1].mlp.experts
    assert experts.w13.dtype == E4M3 and experts.w13_scale is not None and experts.w2_scale is not None
    w13 = experts.w13.float() * experts.w13_scale[..., None]  # dequantized: e4m3 keeps 3 mantissa bits
    w2 = experts.w2.float() * experts.w2_scale[..., None]
    torch.testing.assert_close(w13, hf_experts.gate_up_proj.detach(), rtol=1 / 16, atol=1e-6)
    torch.testing.assert_close(w2, hf_experts.down_proj.detach(), rtol=1 / 16, atol=1e-6)
    assert [len(t) for t in greedy(path, PROMPTS[:2], 6, quantization="fp8")] == [6, 6]


def test_expert_load_counts_every_assignment(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    sched, _ = make_tp_scheduler(checkpoints["qwen3_moe"][0], 1)
    prompt, new = PROMPTS[2], 5
    sched.add_request(Req(rid="a", origin_input_ids=list(prompt),
                          params=SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)))
    run_until_idle(sched)
    stats = sched.stats()
    forwarded = len(prompt) + new - 1  # the last sampled token is never run through the model
    assert sum(stats["moe_expert_assignments"]) == forwarded * 3 * 2  # top-3, two sparse layers
    assert stats["moe_rank_assignments"] == [forwarded * 6] and stats["moe_ep_size"] == 1
    registry, collector = CollectorRegistry(), MoeStatsCollector()
    registry.register(collector)
    collector.update(stats)
    text = generate_latest(registry).decode()
    assert f'radixmesh_moe_expert_assignments_total{{ep_rank="0"}} {float(forwarded * 6)}' in text
    assert "radixmesh_moe_load_imbalance 1.0" in text


def test_expert_load_series_per_rank() -> None:
    registry, collector = CollectorRegistry(), MoeStatsCollector()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert "# TYPE radixmesh_moe_expert_assignments_total counter" in text and "ep_rank=" not in text  # dense
    collector.update({"moe_rank_assignments": [30, 10]})
    text = generate_latest(registry).decode()
    assert 'radixmesh_moe_expert_assignments_total{ep_rank="1"} 10.0' in text
    assert "radixmesh_moe_load_imbalance 1.5" in text


def test_decode_read_bytes_count_the_active_experts(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    from radixmesh.engine.bench.floor import decode_read_bytes

    model = _build(ModelConfig.from_dir(checkpoints["qwen3_moe"][0]))
    read = decode_read_bytes(model)
    per_expert = (2 * 16 * 32 + 32 * 16) * 4  # gate/up [2I, H] and down [H, I], float32
    assert read["active_expert_bytes"] == 2 * 3 * per_expert  # two sparse layers, top-3
    everything = sum(p.numel() * 4 for p in model.parameters())
    experts = 2 * 8 * per_expert
    embedding = 101 * 32 * 4
    assert read["dense_bytes"] == everything - experts - embedding + 32 * 4  # the embedding: one row
