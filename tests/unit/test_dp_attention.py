"""Data-parallel attention without processes: the per-rank slot numbering and accounting, the split of a batch into
the ranks' shares, the layout of a rank, and the refused combinations. (Greedy tokens against EP 1 over real rank
processes: tests/integration/test_dp_attention.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.attention.base import ForwardMode
from radixmesh.engine.batch import PromptLogprobPlan, ScheduleBatch
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.distributed.dp_batch import split_batch
from radixmesh.engine.distributed.layout import ShardLayout, check_tensor_parallel
from radixmesh.engine.dp_kv import DpKVCacheManager, DpSlotAllocator
from radixmesh.engine.memory import ReqToTokenPool, TokenToKVPool
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.request import FinishReason, Req
from radixmesh.wire.sampling import SamplingParams

from .moe_factory import COMMON, KINDS


def manager(rank_size: int = 16, num_ranks: int = 2) -> DpKVCacheManager:
    allocator = DpSlotAllocator(rank_size, num_ranks, "cpu")
    pool = TokenToKVPool(rank_size, 1, 1, 4, torch.float32, "cpu")
    return DpKVCacheManager.over(ReqToTokenPool(8, 64, "cpu"), pool, allocator, disable_cache=False)


def req(ids: list[int], rid: str = "r") -> Req:
    return Req(rid=rid, origin_input_ids=ids, params=SamplingParams(max_new_tokens=4, temperature=0.0))


def test_slots_are_numbered_by_rank_and_freed_to_their_rank() -> None:
    alloc = DpSlotAllocator(4, 3, "cpu")
    one, two = alloc.alloc(2, 1), alloc.alloc(4, 2)
    assert one is not None and two is not None
    assert one.tolist() == [6, 7] and two.tolist() == [11, 12, 13, 14]  # rank r's slot l is r * 5 + l
    assert (one % alloc.stride).tolist() == [1, 2]  # what rank 1 reads
    assert alloc.alloc(1, 2) is None and alloc.available_size() == 6
    alloc.free(torch.cat([two[:1], one]))
    assert [alloc.available_size(r) for r in range(3)] == [4, 4, 1]


def test_requests_spread_over_ranks_and_keep_their_rank_and_prefix_namespace() -> None:
    kv = manager()
    a, b, c = req([1, 2, 3], "a"), req([1, 2, 3, 4], "b"), req([7, 8], "c")
    for r in (a, b, c):
        kv.match(r)
    assert (a.dp_rank, b.dp_rank, c.dp_rank) == (0, 1, 0)
    assert b.cache_key([5]) != a.cache_key([5])  # rank 1's prefixes are its own
    kv.match(b)
    assert b.dp_rank == 1


def _admit(kv: DpKVCacheManager, r: Req) -> None:
    kv.match(r)
    kv.lock(r)
    assert kv.assign_row(r)
    r.extend_len = len(r.origin_input_ids) - len(r.prefix_indices)
    slots = kv.alloc_for([r], [r.extend_len])
    assert slots is not None and r.req_pool_idx is not None
    kv.req_pool.write(r.req_pool_idx, r.kv_len, slots)
    r.kv_len += r.extend_len


def test_each_rank_accounts_for_its_own_slots_and_cache() -> None:
    kv = manager(rank_size=16)
    a, b = req(list(range(10)), "a"), req(list(range(10, 16)), "b")
    _admit(kv, a)
    _admit(kv, b)
    assert (a.dp_rank, b.dp_rank) == (0, 1)
    assert kv.available_tokens(0) == 6 and kv.available_tokens(1) == 10 and kv.available_tokens() == 16
    assert kv.short_rank([a, b]) is None
    for r in (a, b):
        r.finish_reason = FinishReason.LENGTH
        kv.release(r)
    assert kv.rank_stats() == [{"free": 6, "evictable": 10, "live_requests": 0},
                               {"free": 10, "evictable": 6, "live_requests": 0}]
    # a rank short of slots evicts its own cache, never the other rank's
    c = req([50 + i for i in range(12)], "c")
    c.dp_rank, c.cache_namespace = 0, 0
    kv._live[id(c)] = 0
    _admit(kv, c)
    assert kv.tree.rank_evictable == [0, 6]  # a's whole leaf went
    assert [kv.allocator.available_size(r) for r in (0, 1)] == [4, 10]
    assert kv.alloc_slots(5, 0) is None and kv.tree.rank_evictable == [0, 6]


def test_a_short_rank_is_found_by_its_own_requests() -> None:
    kv = manager(rank_size=4)
    a, b = req([1, 2, 3], "a"), req([4, 5], "b")
    _admit(kv, a)
    _admit(kv, b)
    assert kv.short_rank([a, b]) is None
    assert kv.alloc_for([a], [1]) is not None  # rank 0: all 4 slots taken
    assert kv.short_rank([a, b]) == 0 and kv.short_rank([b]) is None


def _batch(reqs: list[Req], extend_lens: list[int], logit_rows: list[int] | None = None) -> ScheduleBatch:
    num = sum(extend_lens)
    plan = PromptLogprobPlan(logit_rows, [], [], []) if logit_rows else None
    return ScheduleBatch(ForwardMode.EXTEND, reqs, list(range(100, 100 + num)), list(range(num)),
                         torch.arange(1, num + 1), [0] * len(reqs), extend_lens, list(range(len(reqs))),
                         prompt_logprobs=plan)


def test_split_gives_each_rank_its_tokens_and_the_logit_rows_their_batch_order() -> None:
    reqs = [req([0]) for _ in range(3)]
    for r, rank in zip(reqs, (1, 0, 1), strict=True):
        r.dp_rank = rank
    batch = _batch(reqs, [2, 3, 4], logit_rows=[0, 6, 7])  # request 0's first row, request 2's rows 1 and 2
    share0, plan = split_batch(batch, 2, 0)
    share1, _ = split_batch(batch, 2, 1)
    assert plan.num_tokens == (3, 6) and plan.num_rows == (1, 5)
    assert share0.input_ids == [102, 103, 104] and share0.out_cache_loc.tolist() == [3, 4, 5]
    assert share1.input_ids == [100, 101, 105, 106, 107, 108] and share1.req_pool_indices == [0, 2]
    assert share1.prompt_logprobs is not None and share1.prompt_logprobs.rows == [0, 3, 4]
    # gathered rows: rank 0 [last of req 1], rank 1 [last of req 0, last of req 2, extra 0, extra 6, extra 7]
    assert plan.row_order == (1, 0, 2, 3, 4, 5)


def test_a_rank_without_requests_gets_an_empty_share() -> None:
    r = req([0])
    r.dp_rank = 0
    share, plan = split_batch(_batch([r], [5]), 2, 1)
    assert plan.num_tokens == (5, 0) and share.reqs == [] and share.out_cache_loc.numel() == 0


def _moe_config(kind: str = "qwen3_moe") -> ModelConfig:
    arch = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3": "Qwen3ForCausalLM"}[kind]
    return ModelConfig.from_hf_dict({**COMMON, **KINDS[kind], "architectures": [arch], "model_type": kind})


def test_a_rank_holds_whole_attention_and_vocabulary_and_a_slice_of_the_dense_mlp() -> None:
    layout = ShardLayout.of(_moe_config(), 1, 2, dp_attention=True)
    assert (layout.num_heads, layout.num_kv_heads, layout.vocab_rows, layout.intermediate_size) == (4, 2, 101, 24)
    assert layout.checkpoint_slice("model.layers.0.self_attn.q_proj.weight") is None
    assert layout.checkpoint_slice("lm_head.weight") is None
    assert layout.checkpoint_slice("model.layers.1.mlp.down_proj.weight") == (1, 24, 24)


def test_a_dense_model_is_refused() -> None:
    with pytest.raises(RadixMeshError, match="runs mixture-of-experts models"):
        check_tensor_parallel(_moe_config("qwen3"), 2, 2, dp_attention=True)


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(tp_size=2, ep_size=1), "--ep-size N"),
    (dict(tp_size=1, ep_size=1), "--tp-size N > 1"),
    (dict(tp_size=2, ep_size=2, speculative_algorithm="ngram"), "--speculative-algorithm"),
    (dict(tp_size=2, ep_size=2, enable_lora=True), "--enable-lora"),
    (dict(tp_size=2, ep_size=2, enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
    (dict(tp_size=2, ep_size=2, device="cuda"), "--disable-cuda-graph"),
])
def test_unsupported_combinations_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(RadixMeshError, match=message):
        EngineConfig(enable_dp_attention=True, **overrides)
    EngineConfig(enable_dp_attention=True, tp_size=2, ep_size=2, device="cpu")
