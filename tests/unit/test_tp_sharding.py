"""Tensor-parallel sharding without processes: head/MLP/vocabulary layouts, the clear errors, and each
rank's weights (safetensors slices, dummy) being exactly its cut of the TP 1 model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.distributed.dummy_weights import iter_whole_dummy_weights
from radixmesh.engine.distributed.layout import ShardLayout, check_tensor_parallel
from radixmesh.engine.distributed.sharding import TensorParallel
from radixmesh.engine.loader import init_dummy_, iter_weight_slices, iter_weights, prepare_model
from radixmesh.engine.loader.dummy import named_shape_config
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.llama import CausalLM

from .scheduler_factory import tiny_model_config
from .tp_factory import TINY_SHAPE, write_tiny_checkpoint


def test_default_model_splits_over_three_ranks() -> None:
    config = named_shape_config("smollm2-135m")  # 9 heads, 3 KV heads, MLP 1536, vocabulary 49152
    layouts = [ShardLayout.of(config, rank, 3) for rank in range(3)]
    assert [(lo.num_heads, lo.num_kv_heads, lo.q_head_begin, lo.kv_head_begin) for lo in layouts] == [
        (3, 1, 0, 0), (3, 1, 3, 1), (3, 1, 6, 2)]
    assert {lo.intermediate_size for lo in layouts} == {512}
    assert [(lo.vocab_begin, lo.vocab_rows, lo.vocab_valid) for lo in layouts] == [
        (0, 16384, 16384), (16384, 16384, 16384), (32768, 16384, 16384)]
    assert not layouts[0].kv_replicated and layouts[0].kv_source_ranks() == [0, 1, 2]


def test_fewer_kv_heads_than_ranks_are_replicated_and_vocabulary_is_padded() -> None:
    config = ModelConfig.from_hf_dict(TINY_SHAPE)  # 8 heads, 2 KV heads, 101 tokens
    layouts = [ShardLayout.of(config, rank, 4) for rank in range(4)]
    assert [lo.kv_head_begin for lo in layouts] == [0, 0, 1, 1]
    assert all(lo.num_kv_heads == 1 and lo.num_heads == 2 for lo in layouts)
    assert layouts[0].kv_replicated and layouts[0].kv_source_ranks() == [0, 2]
    # query heads 0-3 read KV head 0, 4-7 read KV head 1 (group of 4): rank r holds q heads 2r, 2r+1
    assert [(lo.q_head_begin // 4) for lo in layouts] == [lo.kv_head_begin for lo in layouts]
    assert [(lo.vocab_begin, lo.vocab_rows, lo.vocab_valid) for lo in layouts] == [
        (0, 26, 26), (26, 26, 26), (52, 26, 26), (78, 26, 23)]


@pytest.mark.parametrize(("overrides", "tp_size", "words"), [
    ({}, 2, ["9 attention heads", "--tp-size 2"]),
    ({}, 4, ["9 attention heads", "--tp-size 4"]),
    ({"num_attention_heads": 12, "num_key_value_heads": 6}, 4, ["6 KV heads", "--tp-size 4"]),
    ({"num_attention_heads": 12, "num_key_value_heads": 3}, 4, ["--tp-size 4", "3 KV heads"]),
    ({"num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 100}, 8, ["MLP width 100"]),
])
def test_unsplittable_models_get_a_clear_error(overrides: dict, tp_size: int, words: list[str]) -> None:
    cfg = {**named_shape_config("smollm2-135m").raw, **overrides}
    with pytest.raises(RadixMeshError) as info:
        check_tensor_parallel(ModelConfig.from_hf_dict(cfg), tp_size)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and info.value.param == "tp_size"
    for word in words:
        assert word in info.value.message


def _build(config: ModelConfig, rank: int = 0, size: int = 1) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(config, TensorParallel(rank, size))
    model = model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers()
    return model


def expected_shard(name: str, whole: torch.Tensor, config: ModelConfig, layout: ShardLayout) -> torch.Tensor:
    """This test's own statement of what rank `layout.rank` holds of TP 1 parameter `name`."""
    d, lo = config.head_dim, layout
    if ".qkv_proj." in name:
        q, k, v = whole.split([config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d])
        kv = slice(lo.kv_head_begin * d, (lo.kv_head_begin + lo.num_kv_heads) * d)
        return torch.cat([q[lo.q_head_begin * d:(lo.q_head_begin + lo.num_heads) * d], k[kv], v[kv]])
    if ".gate_up_proj." in name:
        gate, up = whole.chunk(2)
        cols = slice(lo.rank * lo.intermediate_size, (lo.rank + 1) * lo.intermediate_size)
        return torch.cat([gate[cols], up[cols]])
    if ".o_proj." in name:
        return whole[:, lo.q_head_begin * d:(lo.q_head_begin + lo.num_heads) * d]
    if ".down_proj." in name:
        return whole[:, lo.rank * lo.intermediate_size:(lo.rank + 1) * lo.intermediate_size]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = torch.zeros(lo.vocab_rows, whole.shape[1], dtype=whole.dtype)
        rows[:lo.vocab_valid] = whole[lo.vocab_begin:lo.vocab_begin + lo.vocab_valid]
        return rows
    return whole


def _check_ranks(whole: CausalLM, ranks: list[CausalLM]) -> None:
    config = whole.config
    reference = dict(whole.named_parameters())
    for model in ranks:
        params = dict(model.named_parameters())
        assert params.keys() == reference.keys()
        for name, param in params.items():
            want = expected_shard(name, reference[name].detach(), config, model.layout)
            assert torch.equal(param.detach(), want), f"rank {model.layout.rank}: {name}"


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("overrides", [{}, {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                            "attention_bias": True, "tie_word_embeddings": True}])
def test_each_rank_reads_its_slices_of_a_safetensors_checkpoint(tmp_path: Path, tp_size: int,
                                                                overrides: dict) -> None:
    prepared = prepare_model(str(write_tiny_checkpoint(tmp_path / "ckpt", **overrides)), progress=False)
    whole = _build(prepared.config)
    whole.load_weights(iter_weights(prepared, progress=False))
    ranks = []
    for rank in range(tp_size):
        model = _build(prepared.config, rank, tp_size)
        model.load_weights(iter_weight_slices(prepared, progress=False))
        ranks.append(model)
    _check_ranks(whole, ranks)


@pytest.mark.parametrize(("config", "tp_size"), [(ModelConfig.from_hf_dict(TINY_SHAPE), 4),
                                                 (tiny_model_config(tie_word_embeddings=True), 2)])
def test_dummy_weights_are_the_tp1_model_cut_by_rank(config: ModelConfig, tp_size: int) -> None:
    whole = _build(config)
    init_dummy_(whole, seed=5)
    ranks = []
    for rank in range(tp_size):
        model = _build(config, rank, tp_size)
        model.load_weights(iter_whole_dummy_weights(config, 5, torch.device("cpu"), torch.float32))
        ranks.append(model)
    _check_ranks(whole, ranks)


def test_a_sharded_layer_without_a_communicator_asserts() -> None:
    model = _build(ModelConfig.from_hf_dict(TINY_SHAPE), 0, 2)
    with pytest.raises(AssertionError, match="communicator"):
        model.model.embed_tokens(torch.tensor([1, 2]))


@pytest.mark.parametrize(("family", "fp8_weights", "fp8_kv", "named"), [
    ("llava", False, False, "'llava'"), ("qwen2_vl", False, False, "'qwen2_vl'"),
    ("llama", True, False, "FP8"), ("qwen2", False, True, "FP8")])
def test_tp_refuses_what_it_does_not_run_yet(family: str, fp8_weights: bool, fp8_kv: bool, named: str) -> None:
    from radixmesh.engine.runner_build import check_tp_combination

    with pytest.raises(RadixMeshError) as info:
        check_tp_combination(family, 2, fp8_weights, fp8_kv)
    assert info.value.param == "tp_size" and named in info.value.message and "--tp-size 2" in info.value.message
    check_tp_combination("qwen3", 2, False, False)  # a text model in the model's dtype runs
