"""A real local cluster: gateway -> tokenizer -> router -> 2 workers, Redis, the default model on CPU.

One cluster for the module (its tests run in order and share it; the worker-kill test is
last). Redis is started and stopped by the fixture, so the tests can restart it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from radixmesh.cluster.local import ClusterSpec, ClusterState, cluster_down, cluster_up
from radixmesh.cluster.processes import grpc_serving, spawn, stop_group
from radixmesh.index.config import IndexConfig
from radixmesh.index.reader import KVIndexReader
from radixmesh.index.redis_server import LocalRedis, free_port
from radixmesh.index.writer import connect
from radixmesh.protocol import common_pb2, router_pb2, router_pb2_grpc, sampling_pb2, worker_pb2
from radixmesh.wire.block_hash import block_hashes
from tests.integration.greedy import greedy_ids
from tests.redis_helpers import start_local_redis

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLOCK = 16
MAX_TOTAL_TOKENS = 4096
PARITY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three primary colors are"]
PARITY_TOKENS = 12


@pytest.fixture(scope="module")
def reference_answers(default_engine: Any) -> dict[str, list[int]]:
    """Greedy output ids of a single local engine (the session's, from an empty prefix cache)."""
    return dict(zip(PARITY_PROMPTS, greedy_ids(default_engine, PARITY_PROMPTS, PARITY_TOKENS)))


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    server = start_local_redis(tmp_path_factory.mktemp("cluster-redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(reference_answers: dict[str, list[int]], redis_server: LocalRedis,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterState]:
    state_dir = tmp_path_factory.mktemp("cluster")
    spec = ClusterSpec(num_workers=2, redis_url=redis_server.url, policy="cache-aware", state_dir=state_dir,
                       worker_args=f"--max-total-tokens {MAX_TOTAL_TOKENS}",
                       router_args="--health-interval-s 0.3 --redis-probe-s 0.3", log_level="info", timeout_s=300)
    state = cluster_up(spec)
    try:
        yield state
    finally:
        cluster_down(state_dir, timeout_s=20)


def generate(state: ClusterState, **body: Any) -> dict[str, Any]:
    response = httpx.post(f"{state.gateway_url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def ids_request(ids: list[int], max_new_tokens: int = 2) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}


def group_ids(group: int, member: int, prefix_blocks: int = 10) -> list[int]:
    """Token ids: a long prefix shared by a group, then a member-specific question."""
    prefix = [1000 + (group * 7919 + i * 31) % 40000 for i in range(prefix_blocks * BLOCK)]
    return prefix + [45000 + member * 13 + i for i in range(9)]


def router_stub(address: str) -> router_pb2_grpc.RouterServiceStub:
    return router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(address))


def policy_of(state: ClusterState) -> str:
    return str(router_stub(state.router_address).ListWorkers(router_pb2.ListWorkersRequest(), timeout=5).policy)


def index_reader(state: ClusterState) -> KVIndexReader:
    assert state.redis_url is not None
    config = IndexConfig(redis_url=state.redis_url, lease_cache_s=0)
    return KVIndexReader(config, connect(config))


def holders(state: ClusterState, ids: list[int]) -> dict[str, int]:
    async def run() -> dict[str, int]:
        reader = index_reader(state)
        try:
            return (await reader.lookup(block_hashes(ids, BLOCK))).cached_blocks
        finally:
            await reader.redis.aclose()

    return asyncio.run(run())


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_greedy_answers_match_a_single_engine(cluster: ClusterState, reference_answers: dict[str, list[int]]) -> None:
    for prompt, expected in reference_answers.items():
        result = generate(cluster, text=prompt, sampling_params={"max_new_tokens": PARITY_TOKENS, "temperature": 0})
        assert result["output_ids"] == expected, prompt
    chat = httpx.post(f"{cluster.gateway_url}/v1/chat/completions", timeout=120, json={
        "model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4,
        "temperature": 0}).json()
    assert chat["choices"][0]["message"]["content"] and chat["usage"]["completion_tokens"] <= 4


def test_groups_land_on_the_worker_holding_their_prefix(cluster: ClusterState) -> None:
    check_groups_land_on_their_prefix_worker(cluster)


def check_groups_land_on_their_prefix_worker(cluster: ClusterState) -> None:
    """Three groups of prompts sharing a 10-block prefix, interleaved: each group's later prompts find their
    prefix cached (they went where it is), and the three new prefixes spread over both workers."""
    cached: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for member in range(3):
        for group in range(3):  # one request at a time, groups interleaved
            result = generate(cluster, **ids_request(group_ids(group, member)))
            cached[group].append(result["meta_info"]["cached_tokens"])
    prefix_len = 10 * BLOCK
    for group, counts in cached.items():
        assert counts[0] == 0, f"group {group}'s first prompt is new"
        assert all(n >= prefix_len for n in counts[1:]), f"group {group} left its prefix's worker: {counts}"
    owners = [holders(cluster, group_ids(g, 0)) for g in range(3)]
    assert all(len(o) == 1 and next(iter(o.values())) >= 10 for o in owners), owners
    assert {next(iter(o)) for o in owners} == set(cluster.worker_addresses), "new prefixes did not spread"


def test_two_routers_on_one_redis_make_the_same_choices(cluster: ClusterState) -> None:
    log_dir = Path(cluster.log_dir)
    address = f"127.0.0.1:{free_port()}"
    pid = spawn("router-2", ["router", "--port", address.rsplit(":", 1)[1], "--metrics-port", "-1",
                             "--redis-url", str(cluster.redis_url), "--workers", ",".join(cluster.worker_addresses),
                             "--health-interval-s", "0.3"], log_dir).pid
    try:
        wait_for(lambda: grpc_serving(address), 60, "the second router")
        stubs = [router_stub(cluster.router_address), router_stub(address)]
        wait_for(lambda: all(w.healthy for w in stubs[1].ListWorkers(router_pb2.ListWorkersRequest()).workers),
                 30, "the second router's health checks")
        chosen: dict[int, set[str]] = {}
        for member in range(2):
            for group in range(10, 13):
                ids = group_ids(group, member)
                stub = stubs[(group + member) % 2]
                request = worker_pb2.GenerateRequest(
                    token_ids=ids, block_hashes=common_pb2.BlockHashes(block_size=BLOCK,
                                                                       hashes=block_hashes(ids, BLOCK)),
                    sampling_params=sampling_pb2.SamplingParams(max_new_tokens=1))
                first = next(iter(stub.Generate(request, timeout=120)))
                chosen.setdefault(group, set()).add(first.routing.worker_id)
        assert all(len(w) == 1 for w in chosen.values()), f"the routers disagreed: {chosen}"
    finally:
        stop_group(pid, "radixmesh", timeout_s=10)


def test_redis_restart_falls_back_to_approx_tree_and_back(cluster: ClusterState, redis_server: LocalRedis) -> None:
    ids = group_ids(20, 0)
    assert generate(cluster, **ids_request(ids))["meta_info"]["cached_tokens"] == 0
    redis_server.stop()
    try:
        result = generate(cluster, **ids_request(group_ids(20, 1)))
        assert result["meta_info"]["cached_tokens"] >= 10 * BLOCK, "approx-tree kept the group together"
        assert policy_of(cluster) == "approx-tree"
    finally:
        redis_server.start()
    wait_for(lambda: policy_of(cluster) == "cache-aware", 20, "the router to use Redis again")
    wait_for(lambda: len(holders(cluster, ids)) == 1, 20, "the workers to republish their blocks")
    result = generate(cluster, **ids_request(group_ids(20, 2)))
    assert result["meta_info"]["cached_tokens"] >= 10 * BLOCK


def test_worker_killed_mid_stream(cluster: ClusterState) -> None:
    """Last: it kills a worker. The open stream moves to the other worker and finishes, new requests go to the other
    worker, nothing hangs, and once the killed worker's lease lapses its index entries stop counting."""
    seeded = _seed_a_group_on_each_worker(cluster)
    router = router_stub(cluster.router_address)
    body = {**ids_request(group_ids(30, 0), max_new_tokens=200), "stream": True}
    body["sampling_params"]["ignore_eos"] = True
    started = time.monotonic()
    frames: list[str] = []
    victim = ""
    with httpx.stream("POST", f"{cluster.gateway_url}/generate", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            frames.append(line[5:].strip())
            if not victim:
                busy = [w for w in router.ListWorkers(router_pb2.ListWorkersRequest()).workers if w.num_inflight]
                assert len(busy) == 1
                victim = busy[0].address
                pid = cluster.pids[f"worker-{cluster.worker_addresses.index(victim)}"]
                os.killpg(pid, signal.SIGKILL)
    assert time.monotonic() - started < 240, "the stream hung"  # a loose bound: only a hang should fail it
    assert frames[-1] == "[DONE]"
    last = json.loads(frames[-2])  # the stream moved to the other worker (migration) and finished there
    assert "error" not in last and last["meta_info"]["completion_tokens"] == 200, last
    survivor = next(a for a in cluster.worker_addresses if a != victim)
    victim_group = seeded[victim]
    for member in range(1, 3):
        result = generate(cluster, **ids_request(group_ids(31, member)))
        assert result["meta_info"]["completion_tokens"] == 2
    # the index is written asynchronously (batched events): wait for the survivor's blocks to land
    wait_for(lambda: set(holders(cluster, group_ids(31, 1))) == {survivor}, 20, "the survivor's blocks in the index")
    wait_for(lambda: victim not in asyncio.run(_live(cluster)), 20, "the killed worker's lease to lapse")
    assert holders(cluster, group_ids(victim_group, 0)) == {}, "a lapsed lease's entries must not count"
    _sweep(cluster)
    assert _entries_of(cluster, victim) == [f"radixmesh:epoch:{victim}"], "the sweep left entries behind"


def _seed_a_group_on_each_worker(state: ClusterState) -> dict[str, int]:
    """New prefixes, one at a time, until each worker holds one in the index: worker -> its group."""
    seeded: dict[str, int] = {}
    for group in range(40, 48):
        ids = group_ids(group, 0)
        generate(state, **ids_request(ids))
        wait_for(lambda: len(holders(state, ids)) == 1, 20, f"group {group}'s blocks in the index")  # noqa: B023
        seeded.setdefault(next(iter(holders(state, ids))), group)
        if len(seeded) == len(state.worker_addresses):
            return seeded
    raise AssertionError(f"new prefixes did not reach every worker: {seeded}")


async def _live(state: ClusterState) -> set[str]:
    reader = index_reader(state)
    try:
        return set(await reader.live_leases(max_age_s=0))
    finally:
        await reader.redis.aclose()


def _sweep(state: ClusterState) -> int:
    async def run() -> int:
        reader = index_reader(state)
        try:
            return await reader.sweep()
        finally:
            await reader.redis.aclose()

    return asyncio.run(run())


def _entries_of(state: ClusterState, worker: str) -> list[str]:
    """Keys, set members and block-hash fields of `worker` still in Redis."""
    import redis

    client = redis.Redis.from_url(str(state.redis_url), decode_responses=True)
    try:
        found = sorted(str(k) for k in client.keys("*") if worker in str(k))
        found += [f"member of {w}" for w in ("radixmesh:workers",) if client.sismember(w, worker)]
        found += [str(k) for k in client.scan_iter("radixmesh:b:*", count=1000) if client.hexists(k, worker)]
        return found
    finally:
        client.close()
