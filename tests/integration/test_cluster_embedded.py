"""`radixmesh cluster up --routers 0`: no router service; the gateway routes in its own process (cache-aware over
the Redis index, the router's flags) and calls two real workers on the default model itself."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixmesh.cluster.local import ClusterSpec, ClusterState, cluster_down, cluster_up
from radixmesh.index.redis_server import LocalRedis
from tests.integration.test_cluster import MAX_TOTAL_TOKENS, check_groups_land_on_their_prefix_worker, generate
from tests.redis_helpers import start_local_redis

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def embedded_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterState]:
    redis: LocalRedis = start_local_redis(tmp_path_factory.mktemp("embedded-redis"))
    state_dir = tmp_path_factory.mktemp("embedded-cluster")
    spec = ClusterSpec(num_workers=2, num_routers=0, redis_url=redis.url, policy="cache-aware", state_dir=state_dir,
                       worker_args=f"--max-total-tokens {MAX_TOTAL_TOKENS}", router_args="--health-interval-s 0.3",
                       log_level="info", timeout_s=300)
    try:
        state = cluster_up(spec)
        try:
            yield state
        finally:
            cluster_down(state_dir, timeout_s=20)
    finally:
        redis.stop()


def test_no_router_process_and_the_gateway_says_where_it_routes(embedded_cluster: ClusterState) -> None:
    state = embedded_cluster
    assert state.router_addresses == [] and state.router_address == ""
    assert not any(name.startswith("router") for name in state.pids)
    ready: dict[str, Any] = httpx.get(f"{state.gateway_url}/ready", timeout=10).json()
    assert ready["ready"] and ready["dependencies"]["router"]["address"] == "in-process", ready
    result = generate(state, text="The capital of France is", sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert len(result["output_ids"]) == 4
    # the router's series are on the gateway's /metrics, labelled as the router's
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{state.gateway_url}/metrics").text)}
    decisions = [s for s in families["radixmesh_router_decisions"].samples if s.name.endswith("_total")]
    assert decisions and all(s.labels["service"] == "router" for s in decisions)
    assert sum(s.value for s in decisions) >= 1
    assert families["radixmesh_ttft_overhead_seconds"].samples


def test_groups_land_on_the_worker_holding_their_prefix(embedded_cluster: ClusterState) -> None:
    check_groups_land_on_their_prefix_worker(embedded_cluster)
