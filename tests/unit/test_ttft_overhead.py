"""The engine's share of the time to first token travels on a worker's first message, and the gateway's
`radixmesh_ttft_overhead_seconds` observes the rest (what the serving path itself added)."""

from __future__ import annotations

import pytest

from radixmesh.gateway.metrics import GatewayMetrics
from radixmesh.protocol import worker_pb2
from radixmesh.wire.convert import proto_to_chunk


def _sample(metrics: GatewayMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


def test_first_message_carries_the_engine_share() -> None:
    first = worker_pb2.GenerateResponse(request_id="r", token_ids=[5], engine_ttft_s=0.0625)
    later = worker_pb2.GenerateResponse(request_id="r", token_ids=[6])
    assert proto_to_chunk(first, "a").engine_ttft_s == 0.0625
    assert proto_to_chunk(later, "b").engine_ttft_s is None
    wire = worker_pb2.GenerateResponse.FromString(first.SerializeToString())
    assert wire.HasField("engine_ttft_s") and wire.engine_ttft_s == 0.0625


def test_overhead_is_ttft_less_the_engine_share() -> None:
    metrics = GatewayMetrics("m")
    metrics.observe_first_token(0.0800, cached_tokens=0, engine_s=0.0771)
    assert _sample(metrics, "radixmesh_ttft_overhead_seconds_count") == 1
    assert _sample(metrics, "radixmesh_ttft_overhead_seconds_sum") == pytest.approx(0.0029)
    # 2.9 ms falls in the 0.25 ms bucket that ends at 3 ms
    assert metrics.registry.get_sample_value("radixmesh_ttft_overhead_seconds_bucket", {"le": "0.00275"}) == 0
    assert metrics.registry.get_sample_value("radixmesh_ttft_overhead_seconds_bucket", {"le": "0.003"}) == 1
    metrics.observe_first_token(0.0800, cached_tokens=0)  # a backend that does not know the engine's share
    assert _sample(metrics, "radixmesh_ttft_overhead_seconds_count") == 1
    assert _sample(metrics, "radixmesh_time_to_first_token_seconds_count") == 2
    metrics.observe_first_token(0.010, cached_tokens=0, engine_s=0.011)  # clocks of two calls: never negative
    assert _sample(metrics, "radixmesh_ttft_overhead_seconds_sum") == pytest.approx(0.0029)
