"""`radixmesh cluster up --tls-dir`: one worker, tokenizer, router and gateway on 127.0.0.1 with mutual TLS on
every link and TLS on the gateway's HTTP and gRPC ports, from a directory laid out like a cert-manager Secret."""

from __future__ import annotations

import shutil
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixmesh.cluster.local import ClusterSpec, ClusterState, cluster_down, cluster_up
from radixmesh.common import tls
from radixmesh.common.errors import RadixMeshError
from radixmesh.index.redis_server import free_port
from radixmesh.protocol import inference_pb2 as pb
from radixmesh.protocol import inference_pb2_grpc
from tests.certs import make_ca

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("cluster-tls")
    ca = make_ca(work, "ca")
    cert = ca.issue(work, "services", dns=["localhost"], ips=["127.0.0.1"])
    secret = work / "secret"
    secret.mkdir()
    shutil.copy(ca.cert_file, secret / "ca.crt")
    shutil.copy(cert.cert_file, secret / "tls.crt")
    shutil.copy(cert.key_file, secret / "tls.key")
    return secret


@pytest.fixture(scope="module")
def cluster(tls_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterState, int]]:
    grpc_port = free_port("127.0.0.1")
    spec = ClusterSpec(num_workers=1, redis_url=None, tls_dir=tls_dir, gateway_args=f"--grpc-port {grpc_port}",
                       worker_args="--max-total-tokens 4096", state_dir=tmp_path_factory.mktemp("cluster-tls-state"),
                       timeout_s=600)
    try:
        state = cluster_up(spec)
        yield state, grpc_port
        cluster_down(spec.state_dir)
    finally:
        tls.configure_clients(None)  # cluster_up set this process's client TLS; leave the next tests plaintext


def test_tls_dir_is_checked(tmp_path: Path) -> None:
    with pytest.raises(RadixMeshError, match=r"lacks ca\.crt, tls\.crt, tls\.key"):
        ClusterSpec(tls_dir=tmp_path)


def test_the_whole_path_runs_over_tls(tls_dir: Path, cluster: tuple[ClusterState, int]) -> None:
    state, grpc_port = cluster
    assert state.gateway_url.startswith("https://")
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8,
            "temperature": 0.0}
    response = httpx.post(state.gateway_url + "/v1/chat/completions", json=body, timeout=120,
                          verify=ssl.create_default_context(cafile=str(tls_dir / "ca.crt")))
    assert response.status_code == 200, response.text
    credentials = grpc.ssl_channel_credentials((tls_dir / "ca.crt").read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{grpc_port}", credentials) as channel:
        reply = inference_pb2_grpc.InferenceServiceStub(channel).Chat(pb.ChatRequest(
            messages=[pb.ChatTurn(role="user", content="What is the capital of France?")],
            options=pb.GenerationOptions(max_tokens=8, temperature=0.0)), timeout=120)
    assert reply.choices[0].content == response.json()["choices"][0]["message"]["content"]


def test_services_refuse_clients_without_the_cluster_certificate(tls_dir: Path,
                                                                 cluster: tuple[ClusterState, int]) -> None:
    state, _ = cluster
    ca_only = grpc.ssl_channel_credentials((tls_dir / "ca.crt").read_bytes())
    for address in (state.worker_addresses[0], state.router_address, state.tokenizer_address):
        for channel in (grpc.insecure_channel(address), grpc.secure_channel(address, ca_only)):
            with channel, pytest.raises(grpc.RpcError) as refused:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, address
