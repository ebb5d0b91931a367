"""LoRA adapters on a real local cluster (Redis, tokenizer, router, gateway, 2 workers of the default model on CPU):
`radixmesh bench lora-routing` places 4 random adapters over the 2 workers through the gateway and every request
lands on the worker holding its adapter (hit rate 1.0, against 0.5 expected of random routing); the workers'
index leases name their adapters; loading and unloading through the gateway reach every worker or the named one,
with 404 / 400 answers naming the unknown adapter or the mismatch."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from radixmesh import cli
from radixmesh.cluster.local import cluster_down, cluster_up
from radixmesh.cluster.lora_affinity import serving_workers
from radixmesh.cluster.spec import ClusterSpec, ClusterState
from radixmesh.engine.bench.lora import write_random_adapters
from radixmesh.engine.loader.default_model import ensure_default_model
from radixmesh.engine.model_config import ModelConfig
from radixmesh.index.config import IndexConfig
from radixmesh.index.reader import KVIndexReader
from radixmesh.index.redis_server import LocalRedis, free_port
from radixmesh.index.writer import connect
from radixmesh.protocol import common_pb2, inference_pb2_grpc
from tests.redis_helpers import start_local_redis

from ..unit.test_lora_adapter import write_adapter

pytestmark = [pytest.mark.integration, pytest.mark.slow]
WORKER_ARGS = "--enable-lora --max-loras-per-batch 2 --max-lora-rank 8 --max-total-tokens 1024"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterState, Path]]:
    root = tmp_path_factory.mktemp("lora-cluster")
    redis: LocalRedis = start_local_redis(root / "redis")
    grpc_port = free_port()
    spec = ClusterSpec(num_workers=2, redis_url=redis.url, worker_args=WORKER_ARGS, state_dir=root / "cluster",
                       router_args="--health-interval-s 0.3", log_level="info", timeout_s=300, metrics=True,
                       gateway_args=f"--grpc-port {grpc_port}")
    (root / "grpc_port").write_text(str(grpc_port))
    try:
        state = cluster_up(spec)
        try:
            yield state, root
        finally:
            cluster_down(spec.state_dir, timeout_s=20)
    finally:
        redis.stop()


def test_requests_land_where_their_adapter_is(cluster: tuple[ClusterState, Path],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    state, root = cluster
    result_file = root / "bench.jsonl"
    code = cli.main(["bench", "lora-routing", "--cluster-state", str(root / "cluster"), "--adapters", "4",
                     "--rank", "8", "--requests", "8", "--max-new-tokens", "1", "--result-file", str(result_file)])
    assert code == 0, capsys.readouterr().out[-3000:]
    result = json.loads(result_file.read_text().splitlines()[-1])
    assert (result["workers"], result["adapters"], result["requests"], result["failed"]) == (2, 4, 8, 0)
    assert result["hit_rate"] == 1.0 and result["random_expected"] == 0.5
    placement = result["placement"]
    assert len(set(placement.values())) == 2  # two adapters on each worker
    for adapter, landed in result["landed"].items():
        assert landed == {placement[adapter]: sum(landed.values())}, (adapter, landed)
    with httpx.Client(base_url=state.gateway_url, timeout=60) as client:  # the bench unloaded what it placed
        assert client.get("/list_lora_adapters").json() == {"adapters": []}
    router = _samples(state, "router")  # the dashboard's per-adapter series
    for adapter, landed in result["landed"].items():
        assert router[("radixmesh_router_lora_decisions_total", adapter, "holder")] == sum(landed.values())
        assert router[("radixmesh_router_lora_loads_total", adapter, "api")] == 1
    tokens = [_samples(state, name).get(("radixmesh_lora_generation_tokens_total", "lora0", "")) or 0
              for name in ("worker-0", "worker-1")]
    assert sorted(tokens)[0] == 0 and sorted(tokens)[1] >= 1  # lora0's tokens, all on its one worker


def _samples(state: ClusterState, service: str) -> dict[tuple[str, str, str], float]:
    """(series, adapter, reason or state) -> value of the LoRA series on a service's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(state.metrics_urls[service], timeout=10).text
    return {(s.name, s.labels.get("adapter", ""), s.labels.get("reason", s.labels.get("state", ""))): s.value
            for family in text_string_to_metric_families(text) if "lora" in family.name for s in family.samples}


def _leases(state: ClusterState) -> dict[str, tuple[str, ...]]:
    async def run() -> dict[str, tuple[str, ...]]:
        assert state.redis_url is not None
        config = IndexConfig(redis_url=state.redis_url, lease_cache_s=0)
        reader = KVIndexReader(config, connect(config))
        try:
            return {wid: lease.lora_adapters for wid, lease in (await reader.live_leases(max_age_s=0)).items()}
        finally:
            await reader.close()

    return asyncio.run(run())


def _wait_leases(state: ClusterState, want: tuple[str, ...], timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        leases = _leases(state)
        if len(leases) == 2 and all(names == want for names in leases.values()):
            return leases
        assert time.monotonic() < deadline, f"leases {leases}, want {want} on both workers"
        time.sleep(0.1)


def _wait_for(condition: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_gateway_loads_everywhere_or_on_one_worker_with_clear_errors(cluster: tuple[ClusterState, Path]) -> None:
    state, root = cluster
    [path] = write_random_adapters(ModelConfig.from_dir(ensure_default_model(False)), root / "extra", 1, 8, seed=7)
    bad = write_adapter(root / "bad", 8, hidden=64)  # another model's shapes
    workers = sorted(serving_workers(state.router_address))
    with httpx.Client(base_url=state.gateway_url, timeout=120) as client, ThreadPoolExecutor(2) as pool:
        running = [pool.submit(client.post, "/v1/completions", json={  # base-model requests the load runs beside
            "prompt": f"Count to twenty, take {i}:", "max_tokens": 16, "ignore_eos": True, "temperature": 0})
            for i in range(2)]
        time.sleep(0.3)
        reply = client.post("/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(path)})
        assert reply.status_code == 200, reply.text
        assert reply.json()["worker_ids"] == workers
        for future in running:  # loading never fails a running request
            done = future.result()
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 16, done.text
        _wait_leases(state, ("sql",))  # both workers' index leases name it
        _wait_for(lambda: all(("radixmesh_lora_adapter_requests", "sql", "running") in _samples(state, w)
                              for w in ("worker-0", "worker-1")), "both workers' sql series")
        listed = client.get("/list_lora_adapters").json()["adapters"]
        assert [(a["name"], a["worker_ids"], a["rank"]) for a in listed] == [("sql", workers, 8)]
        assert [m["id"] for m in client.get("/v1/models").json()["data"]][1:] == ["sql"]
        done = client.post("/v1/completions", json={"model": "sql", "prompt": "Hello", "max_tokens": 1})
        assert done.status_code == 200 and done.json()["model"] == "sql", done.text

        reply = client.post("/unload_lora_adapter", json={"lora_name": "sql", "worker_id": workers[0]})
        assert reply.status_code == 200 and reply.json()["worker_ids"] == [workers[0]], reply.text
        assert client.post("/unload_lora_adapter", json={"lora_name": "sql"}).json()["worker_ids"] == [workers[1]]
        _wait_leases(state, ())
        missing = client.post("/unload_lora_adapter", json={"lora_name": "sql"})
        assert missing.status_code == 404 and "'sql'" in missing.json()["error"]["message"], missing.text
        unknown = client.post("/v1/completions", json={"model": "sql", "prompt": "Hello", "max_tokens": 1})
        assert unknown.status_code == 404 and "sql" in unknown.json()["error"]["message"], unknown.text

        mismatch = client.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
        assert mismatch.status_code == 400, mismatch.text
        message = mismatch.json()["error"]["message"]
        assert "bad" in message and "576" in message and message.startswith("worker "), message
        nowhere = client.post("/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(path),
                                                          "worker_id": "w-none"})
        assert nowhere.status_code == 404 and "'w-none'" in nowhere.json()["error"]["message"], nowhere.text


def test_public_grpc_api_loads_on_a_named_worker(cluster: tuple[ClusterState, Path]) -> None:
    state, root = cluster
    [path] = write_random_adapters(ModelConfig.from_dir(ensure_default_model(False)), root / "grpc", 1, 8, seed=9)
    workers = sorted(serving_workers(state.router_address))
    with grpc.insecure_channel(f"127.0.0.1:{(root / 'grpc_port').read_text()}") as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        reply = stub.LoadLoraAdapter(common_pb2.LoadLoraAdapterRequest(name="g", path=str(path),
                                                                       worker_id=workers[1]), timeout=120)
        assert list(reply.worker_ids) == [workers[1]] and reply.rank == 8
        reply = stub.UnloadLoraAdapter(common_pb2.UnloadLoraAdapterRequest(name="g"), timeout=60)
        assert list(reply.worker_ids) == [workers[1]]
        with pytest.raises(grpc.RpcError) as err:
            stub.UnloadLoraAdapter(common_pb2.UnloadLoraAdapterRequest(name="g"), timeout=60)
        assert err.value.code() is grpc.StatusCode.NOT_FOUND and "'g'" in (err.value.details() or "")
