"""The host tier and prefix sharing with real processes on 127.0.0.1 (default model, CPU, real Redis):
worker A runs with a small KV pool and a host tier, worker B fetches prefixes from peers.

One set of processes for the module; its tests run in order and the last one kills worker A.
Reference answers come from an in-process engine, computed while the workers start.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixmesh.index.config import IndexConfig
from radixmesh.index.reader import KVIndexReader
from radixmesh.index.redis_server import LocalRedis
from radixmesh.index.writer import connect
from radixmesh.protocol import sampling_pb2, worker_pb2, worker_pb2_grpc
from radixmesh.wire.block_hash import block_hashes
from tests.integration.greedy import greedy_ids
from tests.integration.service_procs import ServiceProc, start_service, stop_all, wait_all_ready
from tests.redis_helpers import local_redis  # noqa: F401  (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_NEW_TOKENS = 6
PROMPT_LEN = 360


def prompt_ids(seed: int, length: int = PROMPT_LEN) -> list[int]:
    return [1] + [300 + (i * 53 + seed * 1231) % 9000 for i in range(length - 1)]


PROMPTS = {name: prompt_ids(seed) for seed, name in enumerate(["evicted", "filler1", "filler2", "shared", "killed"])}


def reference_answers(engine: Any) -> dict[str, list[int]]:
    return dict(zip(PROMPTS, greedy_ids(engine, list(PROMPTS.values()), MAX_NEW_TOKENS)))


@pytest.fixture(scope="module")
def started(local_redis: LocalRedis,  # noqa: F811
            default_engine: Any) -> Iterator[tuple[dict[str, ServiceProc], dict[str, list[int]]]]:
    """The two workers, and the reference answers, computed by the session's in-process engine while they
    start."""
    common = ["--device", "cpu", "--max-running-requests", "4", "--redis-url", local_redis.url, "--metrics-port", "0"]
    a = start_service("worker", [*common, "--worker-id", "a", "--max-total-tokens", "900",
                                 "--enable-hierarchical-cache", "--hicache-ratio", "4"], env={"OMP_NUM_THREADS": "1"},
                      wait_ready=False)
    b = start_service("worker", [*common, "--worker-id", "b", "--max-total-tokens", "2048", "--peer-fetch",
                                 "always", "--peer-fetch-timeout-s", "30"], env={"OMP_NUM_THREADS": "1"},
                      wait_ready=False)
    try:
        answers = reference_answers(default_engine)
        wait_all_ready([a, b])
        yield {"a": a, "b": b}, answers
    finally:
        stop_all([a, b], 20)


@pytest.fixture(scope="module")
def workers(started: tuple[dict[str, ServiceProc], dict[str, list[int]]]) -> dict[str, ServiceProc]:
    return started[0]


@pytest.fixture(scope="module")
def reference(started: tuple[dict[str, ServiceProc], dict[str, list[int]]]) -> dict[str, list[int]]:
    return started[1]


def stub(proc: ServiceProc) -> worker_pb2_grpc.WorkerServiceStub:
    return worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(proc.address))


def generate(proc: ServiceProc, name: str, rid: str, peer: worker_pb2.PeerPrefix | None = None,
             ) -> list[worker_pb2.GenerateResponse]:
    request = worker_pb2.GenerateRequest(request_id=rid, token_ids=PROMPTS[name], sampling_params=sampling_pb2.
                                         SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0))
    if peer is not None:
        request.peer_prefix.CopyFrom(peer)
    return list(stub(proc).Generate(request, timeout=300))


def tokens(responses: list[worker_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def engine_stats(proc: ServiceProc) -> dict[str, Any]:
    reply = stub(proc).GetLoad(worker_pb2.GetLoadRequest(), timeout=30)
    stats = {field.name: value for field, value in reply.load.ListFields()}
    stats.update({field.name: value for field, value in reply.disagg.ListFields()})
    return stats


def lookup(redis_url: str, name: str) -> tuple[int, int]:
    """(blocks worker a holds in either tier, of them on its device) of the named prompt."""
    async def run() -> tuple[int, int]:
        config = IndexConfig(redis_url=redis_url, lease_cache_s=0.0)
        reader = KVIndexReader(config, connect(config))
        try:
            match = await reader.lookup(block_hashes(PROMPTS[name], config.block_size))
            return match.blocks_of("a"), match.device_blocks_of("a")
        finally:
            await reader.redis.aclose()

    return asyncio.run(run())


def wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_prompt_evicted_to_host_and_hit_again(workers: dict[str, ServiceProc], reference: dict[str, list[int]],
                                              local_redis: LocalRedis) -> None:  # noqa: F811
    a = workers["a"]
    first = generate(a, "evicted", "e1")
    assert tokens(first) == reference["evicted"] and first[-1].cached_tokens == 0
    for name in ("filler1", "filler2"):  # 900 device slots: the first prompt moves to the host tier
        assert tokens(generate(a, name, name)) == reference[name]
    full = PROMPT_LEN // 16
    wait_for(lambda: lookup(local_redis.url, "evicted") == (full, 0), 20, "the index to show the prompt on the host")
    again = generate(a, "evicted", "e2")
    assert tokens(again) == reference["evicted"]
    assert again[-1].cached_tokens == PROMPT_LEN - 1  # loaded back from the host, not recomputed
    wait_for(lambda: lookup(local_redis.url, "evicted")[1] == full, 20, "the index to show it on the device again")
    assert engine_stats(a).get("kv_used_tokens", 0) == 0


def test_prefix_fetched_from_a_peer_gives_identical_tokens(workers: dict[str, ServiceProc],
                                                           reference: dict[str, list[int]]) -> None:
    a, b = workers["a"], workers["b"]
    assert tokens(generate(a, "shared", "s1")) == reference["shared"]
    peer = worker_pb2.PeerPrefix(worker_id="a", address=a.address, num_tokens=352)
    got = generate(b, "shared", "s2", peer)
    assert tokens(got) == reference["shared"]
    assert got[0].fetched_tokens == 352 and got[-1].cached_tokens == 352
    stats_b = engine_stats(b)
    assert stats_b.get("kv_used_tokens", 0) == 0 and stats_b.get("num_reservations_active", 0) == 0
    wait_for(lambda: engine_stats(a).get("num_transfers_held", 0) == 0, 20, "worker a to release the exported KV")
    assert metric(b, "radixmesh_peer_fetch_tokens_total") == 352
    assert metric(b, "radixmesh_peer_fetch_bytes_total", direction="receive") > 0
    assert metric(a, "radixmesh_peer_fetch_bytes_total", direction="send") > 0
    # the first test's load: all of the prompt but its first token (shared by every prompt, on the device)
    assert metric(a, "radixmesh_cache_hit_tokens_total", tier="host") == PROMPT_LEN - 2
    assert metric(a, "radixmesh_hicache_bytes_total", direction="load") > 0


def test_stale_epoch_is_refused_and_the_prompt_computed(workers: dict[str, ServiceProc],
                                                         reference: dict[str, list[int]]) -> None:
    a, b = workers["a"], workers["b"]
    peer = worker_pb2.PeerPrefix(worker_id="a", address=a.address, num_tokens=352, epoch=987654)
    got = generate(b, "filler1", "f-stale", peer)
    assert tokens(got) == reference["filler1"] and got[0].fetched_tokens == 0
    assert metric(b, "radixmesh_peer_fetches_total", outcome="fallback") == 1


def test_peer_killed_mid_fetch_the_request_completes_by_recomputing(workers: dict[str, ServiceProc],
                                                                     reference: dict[str, list[int]]) -> None:
    a, b = workers["a"], workers["b"]
    assert tokens(generate(a, "killed", "k1")) == reference["killed"]
    a.proc.send_signal(signal.SIGSTOP)  # the fetch starts, and the peer never answers ...
    result: dict[str, Any] = {}

    def run() -> None:
        peer = worker_pb2.PeerPrefix(worker_id="a", address=a.address, num_tokens=352)
        result["responses"] = generate(b, "killed", "k2", peer)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(1.5)
    a.proc.kill()  # ... then dies mid-fetch
    thread.join(120)
    assert not thread.is_alive()
    got = result["responses"]
    assert tokens(got) == reference["killed"] and got[0].fetched_tokens == 0
    assert got[-1].cached_tokens == 1  # computed here: only the first token, which every prompt shares
    stats_b = engine_stats(b)
    assert stats_b.get("kv_used_tokens", 0) == 0 and stats_b.get("num_reservations_active", 0) == 0
    assert metric(b, "radixmesh_peer_fetches_total", outcome="fallback") == 2


def metric(proc: ServiceProc, name: str, **labels: str) -> float:
    port = re.search(r"metrics on :(\d+)", proc.log())
    assert port is not None, "the worker did not log its metrics port"
    text = httpx.get(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
