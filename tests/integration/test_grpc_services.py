"""The tokenizer, worker and gateway services as real processes on 127.0.0.1, over real gRPC.

Reference answers come from `radixmesh serve` (the local engine behind the same HTTP layer).
One process of each for the whole module; the worker is drained by SIGTERM in the last test.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from radixmesh.common.grpc_errors import from_rpc_error
from radixmesh.engine.hf_tokenizer import load_tokenizer
from radixmesh.protocol import common_pb2, sampling_pb2, tokenizer_pb2, tokenizer_pb2_grpc, worker_pb2, worker_pb2_grpc
from radixmesh.wire.block_hash import block_hashes
from tests.integration.service_procs import ServiceProc, grpc_serving, start_service, stop_all, wait_all_ready

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SMALL_ENGINE = ["--device", "cpu", "--max-total-tokens", "4096", "--max-running-requests", "8"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
UNICODE_TEXT = "héllo 你好 🎉 naïve"


@pytest.fixture(scope="module")
def services() -> Iterator[dict[str, ServiceProc]]:
    """The tokenizer service, a worker, `serve`, and two gateways over the first two (one detokenizes with its
    copy of the tokenizer, the other through the tokenizer service), started together."""
    tokenizer = start_service("tokenizer", ["--metrics-port", "-1"], wait_ready=False)
    worker = start_service("worker", [*SMALL_ENGINE, "--worker-id", "worker-a", "--drain-timeout-s", "60"],
                           wait_ready=False)
    upstreams = ["--worker", worker.address, "--tokenizer", tokenizer.address]
    procs = {"tokenizer": tokenizer, "worker": worker,
             "serve": start_service("serve", SMALL_ENGINE, http=True, wait_ready=False),
             "gateway": start_service("gateway", upstreams, http=True, wait_ready=False),
             "gateway-service-detok": start_service("gateway", [*upstreams, "--detokenize", "service",
                                                               "--tokenize", "service"], http=True,
                                                    wait_ready=False)}
    wait_all_ready(list(procs.values()))
    yield procs
    stop_all(list(procs.values()))


@pytest.fixture(scope="module")
def tokenizer_svc(services: dict[str, ServiceProc]) -> ServiceProc:
    return services["tokenizer"]


@pytest.fixture(scope="module")
def worker_svc(services: dict[str, ServiceProc]) -> ServiceProc:
    return services["worker"]


@pytest.fixture(scope="module")
def serve_svc(services: dict[str, ServiceProc]) -> ServiceProc:
    return services["serve"]


@pytest.fixture(scope="module")
def gateway_svc(services: dict[str, ServiceProc]) -> ServiceProc:
    return services["gateway"]


@pytest.fixture(scope="module")
def tok(tokenizer_svc: ServiceProc) -> Iterator[tokenizer_pb2_grpc.TokenizerServiceStub]:
    with grpc.insecure_channel(tokenizer_svc.address) as channel:
        yield tokenizer_pb2_grpc.TokenizerServiceStub(channel)


@pytest.fixture(scope="module")
def worker(worker_svc: ServiceProc) -> Iterator[worker_pb2_grpc.WorkerServiceStub]:
    with grpc.insecure_channel(worker_svc.address) as channel:
        yield worker_pb2_grpc.WorkerServiceStub(channel)


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_dir: Any) -> Any:
    return load_tokenizer(default_model_dir)


def _greedy(max_new_tokens: int, **kwargs: object) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kwargs)


def _generate(worker: worker_pb2_grpc.WorkerServiceStub, ids: list[int], params: sampling_pb2.SamplingParams,
              rid: str = "") -> list[worker_pb2.GenerateResponse]:
    return list(worker.Generate(worker_pb2.GenerateRequest(request_id=rid, token_ids=ids, sampling_params=params),
                                timeout=300))


# ---- health and reflection --------------------------------------------------------------------------
@pytest.mark.parametrize(("svc_name", "service"), [("tokenizer", "radixmesh.v1.TokenizerService"),
                                                   ("worker", "radixmesh.v1.WorkerService")])
def test_health_and_reflection(request: pytest.FixtureRequest, svc_name: str, service: str) -> None:
    svc: ServiceProc = request.getfixturevalue(f"{svc_name}_svc")
    assert grpc_serving(svc.address) and grpc_serving(svc.address, service)
    with grpc.insecure_channel(svc.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="no.Such"), timeout=5)
        assert err.value.code() is grpc.StatusCode.NOT_FOUND
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    assert f"radixmesh {svc_name}: listening on {svc.address}" in svc.log()


@pytest.mark.parametrize("setup", ["busy-port", "bad-block-size"])
def test_bad_service_flags_give_one_clear_line(setup: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1] if setup == "busy-port" else 0
        extra = ["--block-size", "0"] if setup == "bad-block-size" else []
        proc = subprocess.run([sys.executable, "-m", "radixmesh.cli", "tokenizer", "--port", str(port), *extra],
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("radixmesh: error:")]
    expect = "cannot listen on" if setup == "busy-port" else "block_size must be in"
    assert len(lines) == 1 and expect in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


# ---- tokenizer service ------------------------------------------------------------------------------
def test_tokenize_text_and_chat(tok: tokenizer_pb2_grpc.TokenizerServiceStub, hf_tokenizer) -> None:
    text = " ".join(PROMPTS) * 4
    reply = tok.Tokenize(tokenizer_pb2.TokenizeRequest(text=text), timeout=30)
    ids = list(reply.token_ids)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=True)
    assert len(ids) >= 32 and reply.block_hashes.block_size == 16
    assert list(reply.block_hashes.hashes) == block_hashes(ids, 16)
    small = tok.Tokenize(tokenizer_pb2.TokenizeRequest(text=text, block_size=8, extra_key=b"salt"), timeout=30)
    assert list(small.block_hashes.hashes) == block_hashes(ids, 8, b"salt")

    chat = tokenizer_pb2.ChatConversation(messages=[tokenizer_pb2.ChatMessage(**m) for m in QUESTION])
    reply = tok.Tokenize(tokenizer_pb2.TokenizeRequest(chat=chat), timeout=30)
    expected = hf_tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert reply.prompt_text == expected
    assert list(reply.token_ids) == hf_tokenizer.encode(expected, add_special_tokens=False)
    assert list(reply.block_hashes.hashes) == block_hashes(list(reply.token_ids))


def test_tokenizer_info(tok: tokenizer_pb2_grpc.TokenizerServiceStub, hf_tokenizer) -> None:
    info = tok.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest(), timeout=30)
    assert info.vocab_size == len(hf_tokenizer) and info.has_chat_template
    assert list(info.eos_token_ids) == [hf_tokenizer.eos_token_id]
    assert {s.text for s in info.special_tokens} == set(hf_tokenizer.all_special_tokens)
    assert len(info.fingerprint) == 64 and info.block_size == 16


def _detokenize(tok: tokenizer_pb2_grpc.TokenizerServiceStub, pieces: list[list[int]], stop: tuple[str, ...] = (),
                last: tokenizer_pb2.DetokenizeTokens | None = None) -> list[tokenizer_pb2.DetokenizeResponse]:
    def requests() -> Iterator[tokenizer_pb2.DetokenizeRequest]:
        yield tokenizer_pb2.DetokenizeRequest(start=tokenizer_pb2.DetokenizeStart(request_id="t", stop=list(stop)))
        for piece in pieces:
            yield tokenizer_pb2.DetokenizeRequest(tokens=tokenizer_pb2.DetokenizeTokens(token_ids=piece))
        yield tokenizer_pb2.DetokenizeRequest(tokens=last or tokenizer_pb2.DetokenizeTokens(
            finish_reason=common_pb2.FINISH_REASON_LENGTH))

    return list(tok.Detokenize(requests(), timeout=30))


def test_incremental_detokenize_holds_partial_utf8(tok: tokenizer_pb2_grpc.TokenizerServiceStub,
                                                   hf_tokenizer) -> None:
    ids = hf_tokenizer.encode(UNICODE_TEXT, add_special_tokens=False)
    replies = _detokenize(tok, [[t] for t in ids])
    assert len(replies) == len(ids) + 1  # exactly one reply per tokens message
    texts = [r.text for r in replies]
    assert "".join(texts) == UNICODE_TEXT
    assert not any("\ufffd" in t for t in texts)
    assert any(t == "" for t in texts[:-1])  # some tokens end inside a character and were held back


def test_detokenize_stop_strings_and_stop_tokens(tok: tokenizer_pb2_grpc.TokenizerServiceStub,
                                                 hf_tokenizer) -> None:
    ids = hf_tokenizer.encode("one two three four five", add_special_tokens=False)
    replies = _detokenize(tok, [[t] for t in ids], stop=("three",))
    assert "".join(r.text for r in replies) == "one two "
    assert replies[-1].stopped and not replies[0].stopped
    eos = hf_tokenizer.eos_token_id
    last = tokenizer_pb2.DetokenizeTokens(token_ids=[eos], finish_reason=common_pb2.FINISH_REASON_STOP,
                                          ends_with_stop_token=True)
    replies = _detokenize(tok, [ids[:2]], last=last)
    assert "".join(r.text for r in replies) == "one two"


def test_tokenizer_errors_are_exact(tok: tokenizer_pb2_grpc.TokenizerServiceStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        tok.Decode(tokenizer_pb2.DecodeRequest(token_ids=[10**7]), timeout=30)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert from_rpc_error(err.value).param == "token_ids"
    with pytest.raises(grpc.RpcError) as err:
        list(tok.Detokenize(iter([tokenizer_pb2.DetokenizeRequest(tokens=tokenizer_pb2.DetokenizeTokens())]),
                            timeout=30))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    texts = tok.Decode(tokenizer_pb2.DecodeRequest(token_ids=[1, 2, 3], per_token=True), timeout=30).token_texts
    assert len(texts) == 3


# ---- worker service ---------------------------------------------------------------------------------
def test_worker_greedy_tokens_equal_serve(worker: worker_pb2_grpc.WorkerServiceStub, serve_svc: ServiceProc,
                                          hf_tokenizer) -> None:
    for prompt in PROMPTS:
        ids = hf_tokenizer.encode(prompt)
        chunks = _generate(worker, ids, _greedy(8), rid=f"eq-{len(ids)}")
        got = [t for c in chunks for t in c.token_ids]
        ref = httpx.post(serve_svc.address + "/generate", timeout=300, json={
            "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}).json()
        assert got == ref["output_ids"], prompt
        assert chunks[0].worker_id == "worker-a" and chunks[0].request_id == f"eq-{len(ids)}"
        assert chunks[-1].finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
        assert all(c.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
        assert chunks[-1].completion_tokens == len(got) and chunks[-1].prompt_tokens == len(ids)
    again = _generate(worker, hf_tokenizer.encode(PROMPTS[2]), _greedy(2))
    assert again[-1].cached_tokens > 0  # the prefix cache served the repeated prompt


def test_worker_logprobs_and_model_info(worker: worker_pb2_grpc.WorkerServiceStub) -> None:
    chunks = _generate(worker, [1, 504, 3575, 282, 4649, 314], _greedy(3, logprobs=True, top_logprobs=2))
    logprobs = [lp for c in chunks for lp in c.logprobs]
    tops = [t for c in chunks for t in c.top_logprobs]
    assert len(logprobs) == len(tops) == 3 and all(lp <= 0 for lp in logprobs)
    assert all(len(t.entries) == 2 and t.entries[0].logprob >= t.entries[1].logprob for t in tops)
    info = worker.GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=30)
    assert info.model_name == "smollm2-135m-instruct" and info.vocab_size == 49152
    assert info.worker_id == "worker-a" and info.role == common_pb2.WORKER_ROLE_UNIFIED
    assert info.max_total_tokens == 4096 and info.max_running_requests == 8


def test_worker_metrics(worker_svc: ServiceProc, worker: worker_pb2_grpc.WorkerServiceStub) -> None:
    _generate(worker, [1, 2, 3, 4], _greedy(2, ignore_eos=True))
    port = re.search(r"metrics on :(\d+)", worker_svc.log())
    assert port is not None, worker_svc.log()
    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=30).text)}
    finished = {s.labels["finish_reason"]: s.value for s in families["radixmesh_requests_finished"].samples
                if s.name.endswith("_total")}
    assert finished.get("length", 0) >= 1
    ttft_count = [s.value for s in families["radixmesh_time_to_first_token_seconds"].samples
                  if s.name.endswith("_count")]
    assert ttft_count and ttft_count[0] >= 1


def test_worker_rejects_bad_input_with_exact_errors(worker: worker_pb2_grpc.WorkerServiceStub) -> None:
    cases = [(sampling_pb2.SamplingParams(temperature=-1.0), [1, 2], "temperature"),
             (sampling_pb2.SamplingParams(n=2), [1, 2], "n"),
             (sampling_pb2.SamplingParams(), [], "prompt"),
             (sampling_pb2.SamplingParams(), [1, 10**6], "input_ids")]
    for params, ids, param in cases:
        with pytest.raises(grpc.RpcError) as err:
            _generate(worker, ids, params)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, param
        assert from_rpc_error(err.value).param == param
    with pytest.raises(grpc.RpcError) as err:  # a unified worker takes no Prefill calls
        list(worker.Prefill(iter([worker_pb2.PrefillRequest(start=worker_pb2.PrefillStart(token_ids=[1, 2]))]),
                            timeout=30))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and from_rpc_error(err.value).param == "role"


def _wait_idle(worker: worker_pb2_grpc.WorkerServiceStub) -> common_pb2.WorkerLoad:
    deadline = time.monotonic() + 30
    while True:
        load = worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=30).load
        if (load.num_running_reqs == 0 and load.kv_used_tokens == 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.1)


def test_abort_and_cancel_free_kv(worker: worker_pb2_grpc.WorkerServiceStub) -> None:
    long = _greedy(400, ignore_eos=True)
    stream = worker.Generate(worker_pb2.GenerateRequest(request_id="to-abort", token_ids=list(range(100, 140)),
                                                        sampling_params=long), timeout=300)
    first = next(stream)
    assert first.token_ids
    load = worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=30).load
    assert load.num_running_reqs == 1 and load.kv_used_tokens > 0 and load.num_running_decode_tokens > 40
    assert worker.Abort(worker_pb2.AbortRequest(request_id="to-abort"), timeout=30).found
    rest = list(stream)
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert sum(len(c.token_ids) for c in [first, *rest]) < 400
    load = _wait_idle(worker)
    assert load.num_running_reqs == 0 and load.kv_used_tokens == 0
    assert not worker.Abort(worker_pb2.AbortRequest(request_id="to-abort"), timeout=30).found

    stream = worker.Generate(worker_pb2.GenerateRequest(token_ids=list(range(200, 240)), sampling_params=long),
                             timeout=300)
    next(stream)
    stream.cancel()  # the client goes away: the worker aborts the sequence
    load = _wait_idle(worker)
    assert load.num_running_reqs == 0 and load.kv_used_tokens == 0
    assert worker.FlushCache(worker_pb2.FlushCacheRequest(), timeout=30).flushed


# ---- gateway over gRPC --------------------------------------------------------------------------------
def _chat(url: str, **body: object) -> dict[str, Any]:
    response = httpx.post(url + "/v1/chat/completions", timeout=300,
                          json={"model": "smollm2-135m", "messages": QUESTION, "temperature": 0, "max_tokens": 16,
                                **body})
    assert response.status_code == 200, response.text
    return response.json()


def _sse_text(url: str, path: str, body: dict[str, Any]) -> str:
    text = ""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def _text_modes(gateway: ServiceProc, expected: str) -> tuple[str, str]:
    """Where the gateway tokenizes and detokenizes; a local copy of the tokenizer is given 60 s to load."""
    deadline = time.monotonic() + (60 if expected == "local" else 0)
    while True:
        ready = httpx.get(gateway.address + "/ready", timeout=30).json()
        modes = (str(ready["tokenize"]), str(ready["detokenize"]))
        if modes == (expected, expected) or time.monotonic() > deadline:
            return modes
        time.sleep(0.2)


@pytest.mark.parametrize("detokenize", ["local", "service"])
def test_gateway_answers_like_serve(services: dict[str, ServiceProc], serve_svc: ServiceProc, detokenize: str) -> None:
    """The default gateway (its own copy of the tokenizer both ways) and one with `--tokenize service --detokenize
    service` answer as `serve` does."""
    gateway_svc = services["gateway" if detokenize == "local" else "gateway-service-detok"]
    assert _text_modes(gateway_svc, detokenize) == (detokenize, detokenize)
    ours, ref = _chat(gateway_svc.address), _chat(serve_svc.address)
    assert ours["choices"][0]["message"] == ref["choices"][0]["message"]
    assert ours["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    assert ours["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
    assert "Paris" in ours["choices"][0]["message"]["content"]
    body = {"model": "smollm2-135m", "prompt": UNICODE_TEXT + " The capital of France is", "max_tokens": 10,
            "temperature": 0, "stop": ["."], "logprobs": 2}
    for path in ("/v1/completions",):
        plain = httpx.post(gateway_svc.address + path, json=body, timeout=300).json()
        reference = httpx.post(serve_svc.address + path, json=body, timeout=300).json()
        assert plain["choices"][0]["text"] == reference["choices"][0]["text"]
        assert plain["choices"][0]["logprobs"]["tokens"] == reference["choices"][0]["logprobs"]["tokens"]
        assert _sse_text(gateway_svc.address, path, body) == reference["choices"][0]["text"]


def test_gateway_errors_like_serve(gateway_svc: ServiceProc, serve_svc: ServiceProc) -> None:
    for body in ({"temperature": -1}, {"max_tokens": 100000}, {"top_logprobs": 3}):
        ours = httpx.post(gateway_svc.address + "/v1/chat/completions", timeout=60,
                          json={"model": "smollm2-135m", "messages": QUESTION, **body})
        ref = httpx.post(serve_svc.address + "/v1/chat/completions", timeout=60,
                         json={"model": "smollm2-135m", "messages": QUESTION, **body})
        assert (ours.status_code, ours.json()) == (ref.status_code, ref.json()), body
    info = httpx.get(gateway_svc.address + "/get_server_info", timeout=60).json()
    assert info["backend"] == "grpc" and info["max_total_num_tokens"] == 4096


# ---- drain on SIGTERM (stops the module's worker: keep last) -------------------------------------------
def test_sigterm_drains_in_flight_calls(worker_svc: ServiceProc, worker: worker_pb2_grpc.WorkerServiceStub) -> None:
    stream = worker.Generate(worker_pb2.GenerateRequest(token_ids=list(range(300, 320)),
                                                        sampling_params=_greedy(32, ignore_eos=True)), timeout=300)
    chunks = [next(stream)]
    rest: list[worker_pb2.GenerateResponse] = []
    reader = threading.Thread(target=lambda: rest.extend(stream))
    reader.start()
    worker_svc.proc.send_signal(15)
    deadline = time.monotonic() + 10
    while grpc_serving(worker_svc.address) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not grpc_serving(worker_svc.address)  # NOT_SERVING (or refused) while draining
    reader.join(timeout=120)
    chunks += rest
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH  # the open call finished normally
    assert sum(len(c.token_ids) for c in chunks) == 32
    assert worker_svc.proc.wait(timeout=180) == 0  # generous: the machine may be loaded
    assert "radixmesh worker: stopped" in worker_svc.log()
