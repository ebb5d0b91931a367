"""The prefix-sharing cost model and the worker's peer-fetch options."""

from __future__ import annotations

import pytest

from radixmesh.common.errors import RadixMeshError
from radixmesh.worker.config import WorkerConfig
from radixmesh.worker.fetch_cost import MIN_FETCH_SAMPLE_BYTES, OVERHEAD_S, FetchCostModel

KV_BYTES = 131072  # a Llama-3.1-8B token in bf16


def test_fetching_wins_once_the_prefill_is_slower_than_the_link() -> None:
    costs = FetchCostModel("cuda", "grpc", KV_BYTES)
    costs.observe_prefill(8000, 1.0)  # 8k tok/s
    costs.observe_fetch(1 << 30, 1.0 + OVERHEAD_S)  # 1 GiB/s
    small, large = costs.decide(8), costs.decide(16384)
    assert not small.fetch and small.fetch_s > small.compute_s  # the round trip dominates
    assert large.compute_s == pytest.approx(2.048)
    assert large.fetch_s == pytest.approx(OVERHEAD_S + 16384 * KV_BYTES / (1 << 30))
    assert large.fetch is (large.fetch_s < large.compute_s)
    costs.observe_fetch(1 << 30, 20.0)  # the link got slow: computing wins again
    assert not costs.decide(16384).fetch


def test_measurements_replace_the_prior_then_average_and_tiny_samples_are_ignored() -> None:
    costs = FetchCostModel("cpu", "grpc", 1000)
    prior = costs.prefill_tok_s
    costs.observe_prefill(10, 0.001)  # too few tokens to measure
    assert costs.prefill_tok_s == prior
    costs.observe_prefill(1000, 1.0)
    assert costs.prefill_tok_s == 1000
    costs.observe_prefill(1000, 0.5)
    assert costs.prefill_tok_s == pytest.approx(0.8 * 1000 + 0.2 * 2000)
    before = costs.transfer_bytes_s
    costs.observe_fetch(MIN_FETCH_SAMPLE_BYTES - 1, 0.001)
    assert costs.transfer_bytes_s == before and costs.num_fetch_samples == 0


@pytest.mark.parametrize(("overrides", "message"), [
    ({"peer_fetch": "sometimes"}, "peer_fetch must be one of auto, always, off"),
    ({"peer_fetch_timeout_s": 0.0}, "peer_fetch_timeout_s must be in"),
    ({"peer_fetch_min_tokens": 0}, "peer_fetch_min_tokens >= 1"),
])
def test_bad_peer_fetch_options_are_named(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(RadixMeshError, match=message):
        WorkerConfig(**overrides)  # type: ignore[arg-type]


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [("float32", "auto"), ("bfloat16", "auto"),
                                                        ("float16", "auto"), ("bfloat16", "fp8_e4m3"),
                                                        ("bfloat16", "fp8_e5m2")])
def test_kv_bytes_per_token_is_what_the_pool_stores(dtype: str, kv_cache_dtype: str) -> None:
    from types import SimpleNamespace

    import torch

    from radixmesh.engine.memory import TokenToKVPool
    from radixmesh.worker.peer_fetch import kv_bytes_per_token

    shape = SimpleNamespace(num_layers=32, num_kv_heads=8, head_dim=128)
    engine = SimpleNamespace(model_config=shape, config=SimpleNamespace(dtype=dtype, kv_cache_dtype=kv_cache_dtype))
    pool_dtype = {"auto": getattr(torch, dtype), "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    assert kv_bytes_per_token(engine) == TokenToKVPool.bytes_per_token(32, 8, 128, pool_dtype[kv_cache_dtype])
