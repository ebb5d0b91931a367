"""`radixmesh serve --grpc-port` as a real process on the default model, with TLS (certificates made here)
and API keys from a file: the gRPC API answers exactly as the HTTP API for the same requests (greedy and
seeded, streaming and not), both refuse missing or wrong keys and clients without the CA, and no key
reaches the log."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixmesh.protocol import common_pb2, inference_pb2_grpc
from radixmesh.protocol import inference_pb2 as pb
from tests.certs import make_ca
from tests.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEYS = ("sk-serve-key-one-11111111", "sk-serve-key-two-22222222")
STARTUP_TIMEOUT_S = 600.0
FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Served:
    url: str
    grpc_address: str
    ca_file: str
    other_ca_file: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def http(self, key: str | None = KEYS[0]) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, verify=_trusting(self.ca_file), headers=headers, timeout=120)

    def stub(self, ca_file: str | None = None) -> tuple[grpc.Channel, inference_pb2_grpc.InferenceServiceStub]:
        root = Path(ca_file or self.ca_file).read_bytes()
        channel = grpc.secure_channel(self.grpc_address, grpc.ssl_channel_credentials(root))
        return channel, inference_pb2_grpc.InferenceServiceStub(channel)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    workdir = Path(tempfile.mkdtemp(prefix="radixmesh-grpc-serve-"))
    ca, other = make_ca(workdir, "public-ca"), make_ca(workdir, "other-ca")
    cert = ca.issue(workdir, "gateway", dns=["localhost"], ips=["127.0.0.1"], client=False)
    key_file = workdir / "api-keys"
    key_file.write_text(f"# keys\n{KEYS[0]}\n{KEYS[1]}\n")
    port, grpc_port = free_port(), free_port()
    log_path = workdir / "serve.log"
    cmd = [sys.executable, "-m", "radixmesh.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--grpc-port", str(grpc_port), "--device", "cpu", "--api-key-file", str(key_file),
           "--tls-cert", cert.cert_file, "--tls-key", cert.key_file, "--log-level", "debug"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    result = Served(f"https://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", ca.cert_file, other.cert_file, proc,
                    log_path)
    try:
        _wait_healthy(result)
        yield result
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _trusting(ca_file: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca_file)


def _wait_healthy(served: Served) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if served.proc.poll() is not None:
            pytest.fail(f"radixmesh serve exited with {served.proc.returncode}:\n{served.log_path.read_text()}")
        try:
            if httpx.get(served.url + "/health", verify=_trusting(served.ca_file), timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    pytest.fail(f"radixmesh serve did not become healthy:\n{served.log_path.read_text()}")


def _metadata(key: str = KEYS[1]) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


def _options(fields: dict[str, Any]) -> pb.GenerationOptions:
    options = pb.GenerationOptions(**{k: v for k, v in fields.items() if k not in ("logprobs", "response_format")})
    if "logprobs" in fields:
        options.logprobs = True
        options.top_logprobs = fields["logprobs"]
    if "response_format" in fields:
        options.json_schema = json.dumps(fields["response_format"]["json_schema"]["schema"])
    return options


COMPLETION_CASES: list[dict[str, Any]] = [
    {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0.0},
    {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.9, "top_p": 0.9, "seed": 7, "n": 2},
    {"prompt": [1, 504, 3575, 282, 4649, 314], "max_tokens": 6, "temperature": 0.0, "logprobs": 3},
    {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0.0, "stop": ["."]},
]


@pytest.mark.parametrize("body", COMPLETION_CASES, ids=["greedy", "seeded-n2", "token-ids-logprobs", "stop"])
def test_completion_equals_http(served: Served, body: dict[str, Any]) -> None:
    fields = {k: v for k, v in body.items() if k != "prompt"}
    prompt = body["prompt"]
    request = pb.CompleteRequest(options=_options(fields))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    with served.http() as http:
        expected = http.post("/v1/completions", json=body).json()
        events = _sse(http, "/v1/completions", {**body, "stream": True})
    channel, stub = served.stub()
    with channel:
        reply = stub.Complete(request, metadata=_metadata())
        stream = list(stub.StreamComplete(request, metadata=_metadata()))
    assert [(c.index, c.text, FINISH[c.finish_reason]) for c in reply.choices] == \
        [(c["index"], c["text"], c["finish_reason"]) for c in expected["choices"]]
    streamed: dict[int, str] = {}
    for message in stream:
        for c in message.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c["index"]: c["text"] for c in expected["choices"]}
    assert streamed == _sse_texts(events, "text")
    assert reply.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    assert reply.usage.completion_tokens == expected["usage"]["completion_tokens"]
    if "logprobs" in body:
        http_lp = expected["choices"][0]["logprobs"]
        assert [e.token for e in reply.choices[0].logprobs] == http_lp["tokens"]
        assert [e.logprob for e in reply.choices[0].logprobs] == pytest.approx(http_lp["token_logprobs"], abs=1e-5)
        assert all(len(e.top_logprobs) == 3 for e in reply.choices[0].logprobs)


CHAT_CASES: list[dict[str, Any]] = [
    {"messages": QUESTION, "max_tokens": 16, "temperature": 0.0},
    {"messages": [{"role": "system", "content": "Answer with JSON."}, *QUESTION], "max_tokens": 24,
     "temperature": 0.0, "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}},
]


@pytest.mark.parametrize("body", CHAT_CASES, ids=["greedy", "json-schema"])
def test_chat_equals_http(served: Served, body: dict[str, Any]) -> None:
    request = pb.ChatRequest(messages=[pb.ChatTurn(role=m["role"], content=m["content"]) for m in body["messages"]],
                             options=_options({k: v for k, v in body.items() if k != "messages"}))
    with served.http() as http:
        expected = http.post("/v1/chat/completions", json=body).json()
        events = _sse(http, "/v1/chat/completions", {**body, "stream": True})
    channel, stub = served.stub()
    with channel:
        reply = stub.Chat(request, metadata=_metadata())
        stream = list(stub.StreamChat(request, metadata=_metadata()))
    content = expected["choices"][0]["message"]["content"]
    assert reply.choices[0].content == content and content
    assert FINISH[reply.choices[0].finish_reason] == expected["choices"][0]["finish_reason"]
    assert "".join(c.content for m in stream for c in m.choices) == content == _sse_texts(events, "delta")[0]
    assert stream[-1].usage.completion_tokens == expected["usage"]["completion_tokens"]
    if "response_format" in body:
        assert isinstance(json.loads(content)["city"], str)
    repeated = stub_call_cached(served, request)
    assert repeated.usage.cached_tokens > 0  # the prompt is in the radix cache now


def stub_call_cached(served: Served, request: pb.ChatRequest) -> pb.ChatResponse:
    channel, stub = served.stub()
    with channel:
        return stub.Chat(request, metadata=_metadata(KEYS[0]))


def test_list_models(served: Served) -> None:
    channel, stub = served.stub()
    with channel:
        models = stub.ListModels(pb.ListModelsRequest(), metadata=_metadata()).models
    assert [m.id for m in models] == ["smollm2-135m-instruct"] and models[0].max_model_len > 0


def test_keys_are_required_on_both_apis(served: Served) -> None:
    with served.http(key=None) as http:
        assert http.get("/v1/models").status_code == 401
    with served.http(key="sk-not-a-key") as http:
        assert http.get("/v1/models").status_code == 401
    channel, stub = served.stub()
    with channel:
        for metadata in ((), _metadata("sk-not-a-key")):
            with pytest.raises(grpc.RpcError) as caught:
                stub.ListModels(pb.ListModelsRequest(), metadata=metadata)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_clients_without_the_ca_are_refused(served: Served) -> None:
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(served.url + "/health", verify=_trusting(served.other_ca_file), timeout=10)
    plain = served.url.replace("https://", "http://")
    try:  # the TLS port does not speak plaintext HTTP
        response = httpx.get(plain + "/health", timeout=10)
    except httpx.TransportError:
        pass
    else:
        pytest.fail(f"plaintext HTTP got an answer: {response.status_code}")
    with grpc.insecure_channel(served.grpc_address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            inference_pb2_grpc.InferenceServiceStub(channel).ListModels(pb.ListModelsRequest(), metadata=_metadata(),
                                                                        timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    channel, stub = served.stub(served.other_ca_file)
    with channel, pytest.raises(grpc.RpcError) as refused:
        stub.ListModels(pb.ListModelsRequest(), metadata=_metadata(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "CERTIFICATE_VERIFY_FAILED" in (refused.value.details() or "")


def test_keys_never_reach_the_log(served: Served) -> None:
    log = served.log_path.read_text(errors="replace")
    assert "gRPC API (radixmesh.v1.InferenceService)" in log and "(TLS)" in log
    for key in (*KEYS, "sk-not-a-key"):
        assert key not in log


def _sse(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def _sse_texts(events: list[dict[str, Any]], field: str) -> dict[int, str]:
    texts: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            piece = c.get("text") if field == "text" else (c.get("delta") or {}).get("content")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    return texts


def test_example_client(served: Served) -> None:
    script = Path(__file__).resolve().parents[2] / "examples" / "grpc_client.py"
    base = [sys.executable, str(script), "--target", served.grpc_address, "--ca", served.ca_file, "--max-tokens", "8"]
    ok = subprocess.run([*base, "--api-key", KEYS[0], "What is the capital of France?"], capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "model: smollm2-135m-instruct" in ok.stdout and "8 generated]" in ok.stdout
    refused = subprocess.run([*base, "--api-key", "sk-not-a-key", "Hi"], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr


# ---- clients that go away are no error -----------------------------------------------------------------------
def _raw_tls(served: Served, port: int, alpn: str | None = None) -> ssl.SSLSocket:
    context = _trusting(served.ca_file)
    if alpn:
        context.set_alpn_protocols([alpn])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return context.wrap_socket(sock, server_hostname="127.0.0.1")


def _disconnects(served: Served, api: str) -> float:
    metrics = httpx.get(served.url + "/metrics", verify=_trusting(served.ca_file), timeout=10).text
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "radixmesh_client_disconnects_total" and sample.labels.get("api") == api:
                return float(sample.value)
    raise AssertionError(f"no radixmesh_client_disconnects_total{{api={api!r}}} in /metrics")


def _until(check: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_http_client_that_sends_half_a_body_is_one_info_line_and_a_metric(served: Served) -> None:
    before = _disconnects(served, "http")
    log_start = served.log_path.stat().st_size
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    port = int(served.url.rsplit(":", 1)[1])
    with _raw_tls(served, port) as sock:
        sock.sendall(head + body[: len(body) // 2])
    _until(lambda: _disconnects(served, "http") == before + 1)
    log = served.log_path.read_bytes()[log_start:].decode(errors="replace")
    gone = [line for line in log.splitlines() if "went away" in line]
    assert len(gone) == 1 and " INFO " in gone[0] and "/v1/completions" in gone[0], log
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    with served.http() as http:  # and it still serves
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def _h2_frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big") + payload


def _hpack_literal(name: str, value: str) -> bytes:
    """A header field as HPACK "literal without indexing, new name" (lengths below 127, no Huffman)."""
    assert len(name) < 127 and len(value) < 127
    return bytes([0, len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


def test_grpc_client_that_sends_half_a_message_leaves_no_trace(served: Served) -> None:
    """HTTP/2 by hand: a Complete call whose message announces 200 bytes, 20 sent, then the socket closes. gRPC
    never hands the call to the service (no metric to count); nothing may be logged as an error."""
    log_start = served.log_path.stat().st_size
    headers = b"".join(_hpack_literal(k, v) for k, v in (
        (":method", "POST"), (":scheme", "https"), (":path", "/radixmesh.v1.InferenceService/Complete"),
        (":authority", "127.0.0.1"), ("content-type", "application/grpc"), ("te", "trailers"),
        ("authorization", f"Bearer {KEYS[0]}")))
    message = b"\x00" + (200).to_bytes(4, "big") + b"\x0a" * 20
    port = int(served.grpc_address.rsplit(":", 1)[1])
    with _raw_tls(served, port, alpn="h2") as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _h2_frame(4, 0, 0, b"")
                     + _h2_frame(1, 0x4, 1, headers) + _h2_frame(0, 0, 1, message))
        time.sleep(0.5)
    time.sleep(1.0)
    log = served.log_path.read_bytes()[log_start:].decode(errors="replace")
    assert "Traceback" not in log and " ERROR " not in log, log
    channel, stub = served.stub()
    with channel:
        reply = stub.Complete(pb.CompleteRequest(text="Hi", options=pb.GenerationOptions(max_tokens=2)),
                              metadata=_metadata(), timeout=120)
    assert reply.usage.completion_tokens == 2


def test_grpc_client_that_cancels_is_one_info_line_and_a_metric(served: Served) -> None:
    before = _disconnects(served, "grpc")
    log_start = served.log_path.stat().st_size
    channel, stub = served.stub()
    with channel:
        call = stub.StreamComplete(pb.CompleteRequest(text="Count to a thousand:", options=pb.GenerationOptions(
            max_tokens=500, ignore_eos=True)), metadata=_metadata(), timeout=120)
        next(call)
        call.cancel()
    _until(lambda: _disconnects(served, "grpc") == before + 1)
    log = served.log_path.read_bytes()[log_start:].decode(errors="replace")
    assert sum("went away" in line for line in log.splitlines()) == 1, log
    assert "Traceback" not in log, log
