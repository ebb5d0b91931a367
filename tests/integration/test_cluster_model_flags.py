"""`cluster up` with one set of model flags on a model directory of a dummy-weights shape.

The directory holds a tiny config.json and the default model's tokenizer files, no weights:
every service gets `--model DIR --load-format dummy`, the tokenizer service starts without a
checkpoint, two router replicas serve the gateway, and the gateway describes the model as
`radixmesh serve` does (tokenizer path included), so `bench serving` needs no `--tokenizer`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from loadtests.__main__ import main as bench_main
from radixmesh.cluster.local import ClusterSpec, ClusterState, cluster_down, cluster_up, router_sees_all
from radixmesh.engine.config import EngineConfig
from radixmesh.protocol import tokenizer_pb2, tokenizer_pb2_grpc
from tests.integration.service_procs import ServiceProc, start_service, wait_all_ready

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
ENGINE_ARGS = ["--max-total-tokens", "2048"]


@pytest.fixture(scope="module")
def dummy_model_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dummy-weights shape: the default model's config at a tiny size, its tokenizer files, no weights."""
    out = tmp_path_factory.mktemp("dummy-model")
    config = json.loads((default_model_dir / "config.json").read_text())
    config.update(TINY_SHAPE)
    config.pop("head_dim", None)
    (out / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, out / name)
    assert not list(out.glob("*.safetensors"))
    return out


@pytest.fixture(scope="module")
def serve_started(dummy_model_dir: Path) -> Iterator[ServiceProc]:
    """`radixmesh serve` on the same model, the reference for the gateway's informational endpoints; not waited
    on here, so that it loads while the cluster starts."""
    proc = start_service("serve", ["--model", str(dummy_model_dir), "--load-format", "dummy", "--device", "cpu",
                                   *ENGINE_ARGS], http=True, wait_ready=False)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def cluster(serve_started: ServiceProc, dummy_model_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterState]:
    state_dir = tmp_path_factory.mktemp("cluster-model-flags")
    spec = ClusterSpec(num_workers=1, num_routers=2, model=str(dummy_model_dir), load_format="dummy",
                       state_dir=state_dir, worker_args=" ".join(ENGINE_ARGS), tokenizer_args="--block-size 32",
                       router_args="--health-interval-s 0.3", log_level="info", timeout_s=300)
    state = cluster_up(spec)
    try:
        yield state
    finally:
        cluster_down(state_dir, timeout_s=20)


@pytest.fixture(scope="module")
def serve(serve_started: ServiceProc, cluster: ClusterState) -> ServiceProc:
    wait_all_ready([serve_started])
    return serve_started


def test_every_service_got_the_model_flags_and_the_tokenizer_needs_no_weights(cluster: ClusterState,
                                                                              dummy_model_dir: Path) -> None:
    assert cluster.model_args == ["--model", str(dummy_model_dir), "--load-format", "dummy"]
    assert len(set(cluster.router_addresses)) == 2 and cluster.router_address == cluster.router_addresses[0]
    assert cluster.router_names == ["router-0", "router-1"]
    for address in cluster.router_addresses:  # each replica routes to the worker on its own
        assert router_sees_all(address, len(cluster.worker_addresses))
    with grpc.insecure_channel(cluster.tokenizer_address) as channel:
        info = tokenizer_pb2_grpc.TokenizerServiceStub(channel).GetTokenizerInfo(
            tokenizer_pb2.GetTokenizerInfoRequest(), timeout=30)
    assert Path(info.tokenizer_path) == dummy_model_dir.resolve()
    assert info.block_size == 32  # --tokenizer-args reached it
    response = httpx.post(f"{cluster.gateway_url}/v1/completions", timeout=120,
                          json={"model": dummy_model_dir.name, "prompt": "Hello there", "max_tokens": 3,
                                "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def test_model_info_answers_like_serve(cluster: ClusterState, serve: ServiceProc) -> None:
    gateway = httpx.get(f"{cluster.gateway_url}/model_info", timeout=30).json()
    local = httpx.get(f"{serve.address}/model_info", timeout=30).json()
    assert set(gateway) == set(local)
    assert gateway["tokenizer_path"] and gateway == local  # same model, same tokenizer, same context


def test_server_info_answers_like_serve(cluster: ClusterState, serve: ServiceProc) -> None:
    gateway = httpx.get(f"{cluster.gateway_url}/server_info", timeout=30).json()
    local = httpx.get(f"{serve.address}/server_info", timeout=30).json()
    model_keys = set(httpx.get(f"{serve.address}/model_info", timeout=30).json())
    engine_keys = EngineConfig.field_names()
    same = ("model", "load_format", "tokenizer", "dtype", "max_total_tokens", "max_running_requests",
            *model_keys)
    assert model_keys | engine_keys <= set(gateway) & set(local)
    assert {key: gateway[key] for key in same} == {key: local[key] for key in same}


def test_bench_serving_finds_the_tokenizer_through_the_gateway(cluster: ClusterState, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    code = bench_main(["serving", "--base-url", cluster.gateway_url, "--num-prompts", "2", "--random-input-len", "16",
                       "--random-output-len", "3", "--warmup-requests", "0", "--disable-tqdm",
                       "--request-timeout-s", "120", "--output-file", str(out)])
    assert code == 0, capsys.readouterr().err
    assert "/model_info tokenizer_path" in capsys.readouterr().err
    assert json.loads(out.read_text())["runs"][0]["summary"]["num_completed"] == 2

