"""TLS with certificates made in the test: the gateway's public gRPC port (TLS, no client certificates),
an internal service's port (mutual TLS, plus its plaintext health port), certificate rotation, the
process-wide client settings, and clear errors for bad files."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixmesh.common import tls
from radixmesh.common.errors import RadixMeshError
from radixmesh.common.grpc_server import GrpcServer, GrpcServerConfig
from radixmesh.common.tls import TlsConfig
from radixmesh.gateway.config import GatewayConfig
from radixmesh.protocol import inference_pb2 as pb
from radixmesh.protocol import inference_pb2_grpc
from tests.certs import CertificateAuthority, Issued, make_ca
from tests.unit.grpc_api_harness import gateway

LOCAL = {"dns": ["localhost"], "ips": ["127.0.0.1"]}


@pytest.fixture
def pki(tmp_path: Path) -> tuple[CertificateAuthority, CertificateAuthority, Issued, Issued]:
    """(the CA, another CA, a server certificate and a client certificate of the CA)."""
    ca, other = make_ca(tmp_path, "ca"), make_ca(tmp_path, "other-ca")
    return ca, other, ca.issue(tmp_path, "server", **LOCAL), ca.issue(tmp_path, "client", server=False)


def _credentials(ca: CertificateAuthority | None, client: Issued | None = None) -> grpc.ChannelCredentials:
    key = Path(client.key_file).read_bytes() if client else None
    chain = Path(client.cert_file).read_bytes() if client else None
    return grpc.ssl_channel_credentials(Path(ca.cert_file).read_bytes() if ca else None, key, chain)


async def _health(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return int(reply.status)


def test_bad_files_are_refused_naming_the_flag(tmp_path: Path, pki: tuple) -> None:
    ca, _, server, client = pki
    cases = [({"cert_file": server.cert_file}, "tls_key"),
             ({"cert_file": str(tmp_path / "nope.crt"), "key_file": server.key_file}, "tls_cert"),
             ({"cert_file": server.cert_file, "key_file": client.key_file}, "tls_cert"),
             ({"cert_file": server.cert_file, "key_file": server.key_file, "ca_file": server.key_file}, "tls_ca"),
             ({"ca_file": ca.cert_file}, "tls_ca"),
             ({"client_cert_file": client.cert_file}, "tls_client_key")]
    for kwargs, param in cases:
        with pytest.raises(RadixMeshError) as caught:
            TlsConfig(**kwargs)
        assert caught.value.param == param, (kwargs, caught.value)
        assert caught.value.message.startswith(f"--{param.replace('_', '-')}") or param in caught.value.message \
            or f"--{param.replace('_', '-')}" in caught.value.message


def test_gateway_grpc_port_serves_tls(pki: tuple) -> None:
    ca, other, server, _ = pki
    config = GatewayConfig(grpc_port=0, tls=TlsConfig(cert_file=server.cert_file, key_file=server.key_file))

    async def run() -> None:
        async with gateway(config=config) as gw:
            async with grpc.aio.secure_channel(gw.address, _credentials(ca)) as channel:
                stub = inference_pb2_grpc.InferenceServiceStub(channel)
                reply = await stub.Complete(pb.CompleteRequest(text="hi", options=pb.GenerationOptions(max_tokens=2)))
                assert reply.choices[0].text  # no client certificate needed on the public port
            async with grpc.aio.insecure_channel(gw.address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as plaintext:
                    await _health(channel)
                assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.secure_channel(gw.address, _credentials(other)) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as untrusted:
                    await _health(channel)
                assert untrusted.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "CERTIFICATE_VERIFY_FAILED" in (untrusted.value.details() or "")

    asyncio.run(run())


def test_internal_port_requires_a_client_certificate(tmp_path: Path, pki: tuple) -> None:
    ca, other, server, client = pki
    stranger = other.issue(tmp_path, "stranger", server=False)
    config = GrpcServerConfig(port=0, metrics_port=-1, health_port=0,
                              tls=TlsConfig(cert_file=server.cert_file, key_file=server.key_file, ca_file=ca.cert_file))

    async def run() -> None:
        service = GrpcServer(config, "test", [])
        await service.start()
        try:
            address = f"127.0.0.1:{service.port}"
            async with grpc.aio.secure_channel(address, _credentials(ca, client)) as channel:
                assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
            for credentials in (_credentials(ca), _credentials(ca, stranger)):  # no certificate, or a foreign one
                async with grpc.aio.secure_channel(address, credentials) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await _health(channel)
                    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.insecure_channel(f"127.0.0.1:{service.health_port}") as channel:  # kubelet probes
                assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
        finally:
            tls.configure_clients(None)
            await service.server.stop(0)
            await service.drain()

    asyncio.run(run())


def test_rotated_certificate_is_served_without_restart(tmp_path: Path, pki: tuple) -> None:
    ca, other, server, _ = pki
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(server.cert_file, live / "tls.crt")
    shutil.copy(server.key_file, live / "tls.key")
    config = GatewayConfig(grpc_port=0, tls=TlsConfig(cert_file=str(live / "tls.crt"), key_file=str(live / "tls.key")))
    renewed = other.issue(tmp_path, "renewed", **LOCAL)

    async def run() -> None:
        async with gateway(config=config) as gw:
            async with grpc.aio.secure_channel(gw.address, _credentials(ca)) as channel:
                assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
            shutil.copy(renewed.key_file, live / "tls.key")
            shutil.copy(renewed.cert_file, live / "tls.crt")
            os.utime(live / "tls.crt", ns=(1, 1))  # a different stamp even within the clock's resolution
            async with grpc.aio.secure_channel(gw.address, _credentials(other)) as channel:
                assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(run())


def test_client_settings_reach_spawned_processes(pki: tuple) -> None:
    ca, _, server, client = pki
    config = TlsConfig(cert_file=server.cert_file, key_file=server.key_file, ca_file=ca.cert_file,
                       client_cert_file=client.cert_file, client_key_file=client.key_file, server_name="radixmesh")
    try:
        tls.configure_clients(config)
        assert os.environ["RADIXMESH_TLS_CA"] == ca.cert_file
        assert os.environ["RADIXMESH_TLS_CLIENT_CERT"] == client.cert_file
        tls._client_resolved = False  # as a spawned process starts: nothing configured, the environment set
        seen = tls.client_tls()
        assert seen is not None and seen.ca_file == ca.cert_file and seen.client_cert_file == client.cert_file
        assert seen.channel_options() == [("grpc.ssl_target_name_override", "radixmesh")]
    finally:
        tls.configure_clients(None)
    assert "RADIXMESH_TLS_CA" not in os.environ and tls.client_tls() is None
