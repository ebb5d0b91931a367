"""Mutual TLS between the services as real processes on 127.0.0.1 (default model, CPU): a prefill and a
decode worker, a router, the tokenizer, the grammar service and the gateway, every link with certificates
made here.

The internal certificate names only `radixmesh-internal` (no IP), and every service checks peers for that
name (--tls-server-name), as the Helm chart sets it up: pods are dialled by IP. The gateway's public ports
serve a certificate of another CA and ask clients for none (they present API keys). Checked: a request
goes gateway -> tokenizer, gateway -> router -> decode -> prefill (KV over the grpc transport) and back,
identical on HTTP and gRPC; the workers' schedulers fetch structured-output grammars from the grammar
service; workers refuse clients without a certificate of the cluster's CA, and a router holding a
certificate of another CA cannot use them.
"""

from __future__ import annotations

import json
import re
import ssl
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from radixmesh.common.grpc_server import NOT_READY_METADATA_KEY
from radixmesh.protocol import inference_pb2 as pb
from radixmesh.protocol import inference_pb2_grpc, router_pb2, router_pb2_grpc, sampling_pb2, worker_pb2
from tests.certs import Issued, make_ca
from tests.integration.service_procs import ServiceProc, start_service, stop_all, wait_all_ready

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SERVER_NAME = "radixmesh-internal"
API_KEY = "sk-tls-services-key"
ENGINE = ["--device", "cpu", "--max-total-tokens", "4096", "--max-running-requests", "4"]
QUESTION = "What is the capital of France? Answer in one short sentence, please."


@dataclass
class Pki:
    ca: str
    internal: Issued
    public_ca: str
    public: Issued
    rogue: Issued
    """A certificate for SERVER_NAME signed by another CA."""

    def internal_flags(self, cert: Issued | None = None) -> list[str]:
        cert = cert or self.internal
        return ["--tls-cert", cert.cert_file, "--tls-key", cert.key_file, "--tls-ca", self.ca,
                "--tls-server-name", SERVER_NAME]

    def credentials(self, cert: Issued | None = None, ca: str | None = None) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(Path(ca or self.ca).read_bytes(),
                                            Path(cert.key_file).read_bytes() if cert else None,
                                            Path(cert.cert_file).read_bytes() if cert else None)

    def channel(self, address: str, cert: Issued | None = None) -> grpc.Channel:
        return grpc.secure_channel(address, self.credentials(cert),
                                   options=[("grpc.ssl_target_name_override", SERVER_NAME)])


@pytest.fixture(scope="module")
def pki() -> Pki:
    workdir = Path(tempfile.mkdtemp(prefix="radixmesh-mtls-"))
    ca, public_ca, other = make_ca(workdir, "cluster-ca"), make_ca(workdir, "public-ca"), make_ca(workdir, "other")
    return Pki(ca.cert_file, ca.issue(workdir, "internal", dns=[SERVER_NAME]), public_ca.cert_file,
               public_ca.issue(workdir, "gateway", dns=["localhost"], ips=["127.0.0.1"], client=False),
               other.issue(workdir, "rogue", dns=[SERVER_NAME]))


@pytest.fixture(scope="module")
def services(pki: Pki) -> Iterator[dict[str, ServiceProc]]:
    """Every service, started together (each waits for what it needs)."""
    tls = pki.internal_flags()
    procs: dict[str, ServiceProc] = {}
    try:
        procs["grammar"] = start_service("grammar", [*tls, "--metrics-port", "-1"], health_port=True,
                                         wait_ready=False)
        common = [*ENGINE, *tls, "--kv-transport", "grpc", "--metrics-port", "0", "--grammar-service",
                  procs["grammar"].address]
        for role in ("prefill", "decode"):
            procs[role] = start_service("worker", [*common, "--role", role, "--worker-id", f"{role}-0"],
                                        env={"OMP_NUM_THREADS": "1"}, health_port=True, wait_ready=False)
        procs["tokenizer"] = start_service("tokenizer", [*tls, "--metrics-port", "-1"], health_port=True,
                                           wait_ready=False)
        workers = f"{procs['prefill'].address},{procs['decode'].address}"
        procs["router"] = start_service("router", ["--workers", workers, "--pd-min-prefill-tokens", "8",
                                                   "--health-interval-s", "0.3", "--metrics-port", "-1", *tls],
                                        health_port=True, wait_ready=False)
        procs["gateway"] = _start_gateway(pki, procs)
        wait_all_ready([proc for name, proc in procs.items() if name != "gateway"])
        _wait_gateway(pki, procs["gateway"])  # its /health answers over TLS only
        yield procs
    finally:
        stop_all(list(procs.values()), 20)


def _start_gateway(pki: Pki, procs: dict[str, ServiceProc]) -> ServiceProc:
    from tests.ports import free_port

    grpc_port = free_port()
    args = ["--router", procs["router"].address, "--tokenizer", procs["tokenizer"].address, "--grpc-port",
            str(grpc_port), "--api-key", API_KEY, "--tls-cert", pki.public.cert_file, "--tls-key", pki.public.key_file,
            "--tls-ca", pki.ca, "--tls-client-cert", pki.internal.cert_file, "--tls-client-key", pki.internal.key_file,
            "--tls-server-name", SERVER_NAME]
    gateway = start_service("gateway", args, http=True, wait_ready=False)
    gateway.address = gateway.address.replace("http://", "https://")
    gateway.health_address = f"127.0.0.1:{grpc_port}"  # here: the public gRPC port
    return gateway


def _wait_gateway(pki: Pki, gateway: ServiceProc) -> None:
    deadline = time.monotonic() + 120
    with httpx.Client(verify=_trusting(pki.public_ca), timeout=2) as client:
        while time.monotonic() < deadline:
            assert gateway.proc.poll() is None, gateway.log()
            try:
                if client.get(gateway.address + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    raise AssertionError(f"the gateway did not become ready over mutual TLS:\n{gateway.log()}")


def _trusting(ca_file: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca_file)


def test_requests_cross_every_mutual_tls_link(pki: Pki, services: dict[str, ServiceProc]) -> None:
    gateway = services["gateway"]
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12, "temperature": 0.0}
    response = httpx.post(gateway.address + "/v1/chat/completions", json=body, verify=_trusting(pki.public_ca),
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["message"]["content"]
    credentials = grpc.ssl_channel_credentials(Path(pki.public_ca).read_bytes())
    with grpc.secure_channel(gateway.health_address, credentials) as channel:
        reply = inference_pb2_grpc.InferenceServiceStub(channel).Chat(
            pb.ChatRequest(messages=[pb.ChatTurn(role="user", content=QUESTION)],
                           options=pb.GenerationOptions(max_tokens=12, temperature=0.0)),
            metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=120)
    assert reply.choices[0].content == content and content


def _wait_until_healthy(stub: router_pb2_grpc.RouterServiceStub, addresses: set[str], timeout_s: float = 60) -> None:
    """Until the router's health checks pass for every worker in `addresses` (on a loaded machine a probe can
    time out and take a worker out for a while; the router then routes around it, by design)."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers
        if addresses <= {w.address for w in workers if w.healthy}:
            return
        assert time.monotonic() < deadline, f"workers not healthy at the router: {workers}"
        time.sleep(0.2)


def test_router_sends_prompts_through_the_prefill_tier(pki: Pki, services: dict[str, ServiceProc]) -> None:
    request = worker_pb2.GenerateRequest(token_ids=list(range(300, 360)),
                                         sampling_params=sampling_pb2.SamplingParams(max_new_tokens=4, temperature=0))
    with pki.channel(services["router"].address, pki.internal) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        _wait_until_healthy(stub, {services["prefill"].address, services["decode"].address})
        messages = list(stub.Generate(request, timeout=120))
    routing = messages[0].routing
    assert routing.worker_address == services["decode"].address, routing
    assert routing.prefill_worker_address == services["prefill"].address, routing
    assert routing.pd_reason == "prefill-tier"
    assert sum(len(m.token_ids) for m in messages) == 4  # decode got the prefill's KV over mutual TLS


def test_workers_fetch_grammars_over_mutual_tls(pki: Pki, services: dict[str, ServiceProc]) -> None:
    """The workers' scheduler processes (spawned, so told by the environment) call the grammar service."""
    schema = json.dumps({"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]})
    credentials = grpc.ssl_channel_credentials(Path(pki.public_ca).read_bytes())
    with grpc.secure_channel(services["gateway"].health_address, credentials) as channel:
        reply = inference_pb2_grpc.InferenceServiceStub(channel).Chat(
            pb.ChatRequest(messages=[pb.ChatTurn(role="user", content=QUESTION)],
                           options=pb.GenerationOptions(max_tokens=24, temperature=0.0, json_schema=schema)),
            metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=120)
    assert reply.choices[0].content.startswith("{")
    deadline = time.monotonic() + 20
    while True:  # worker metrics follow the scheduler's stats each second
        fetched = sum(_metric(services[w], "radixmesh_grammar_fetches_total") for w in ("prefill", "decode"))
        if fetched >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert fetched >= 1, "no worker fetched the grammar from the grammar service"
    assert sum(_metric(services[w], "radixmesh_grammar_compiles_total") for w in ("prefill", "decode")) == 0


def _metric(proc: ServiceProc, name: str) -> float:
    port = re.search(r"metrics on :(\d+)", proc.log())
    assert port is not None, proc.log()
    text = httpx.get(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def test_workers_refuse_clients_without_an_accepted_certificate(pki: Pki, services: dict[str, ServiceProc]) -> None:
    address = services["prefill"].address
    with pki.channel(address, pki.internal) as channel:
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
    for label, channel in (("plaintext", grpc.insecure_channel(address)),
                           ("no client certificate", pki.channel(address)),
                           ("another CA's certificate", pki.channel(address, pki.rogue))):
        with channel, pytest.raises(grpc.RpcError) as refused:
            _health(channel)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, label


def test_a_router_with_a_foreign_certificate_cannot_reach_workers(pki: Pki, services: dict[str, ServiceProc]) -> None:
    workers = f"{services['prefill'].address},{services['decode'].address}"
    rogue = start_service("router", ["--workers", workers, "--health-interval-s", "0.3", "--metrics-port", "-1",
                                     *pki.internal_flags(pki.rogue)], health_port=True, wait_ready=False)
    try:
        deadline, reason = time.monotonic() + 60, ""
        while "none of 2 workers is healthy" not in reason and time.monotonic() < deadline:
            assert rogue.proc.poll() is None, rogue.log()
            time.sleep(0.1)
            reason = _not_ready_reason(rogue.health_address)
        assert "none of 2 workers is healthy" in reason, reason  # the workers refused its certificate
        assert services["prefill"].address in reason or services["decode"].address in reason
    finally:
        rogue.stop(10)


def _health(channel: grpc.Channel) -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return int(reply.status)


def _not_ready_reason(health_address: str) -> str:
    try:
        with grpc.insecure_channel(health_address) as channel:
            reply, call = health_pb2_grpc.HealthStub(channel).Check.with_call(health_pb2.HealthCheckRequest(),
                                                                              timeout=5)
    except grpc.RpcError:
        return ""
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return "SERVING"
    return next((str(v) for k, v in call.trailing_metadata() or () if k == NOT_READY_METADATA_KEY), "")
