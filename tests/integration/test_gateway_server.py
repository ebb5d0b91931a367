"""`radixmesh serve` as a real process on 127.0.0.1, driven by the official `openai` client and httpx.

One server for the whole module (started once, killed by PID at the end). It has an API key,
so every call below passes it, and a small queue (4 running + 2 queued sequences) so that
overload is reachable with a handful of requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.ports import free_port

from .serve_process import API_KEY, Server, wait_healthy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    port = free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="radixmesh-gateway-test-"))
    log_path = log_dir / "serve.log"
    cmd = [sys.executable, "-m", "radixmesh.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--api-key", API_KEY, "--max-running-requests", "4", "--max-queued-requests", "2",
           "--graceful-shutdown-s", "1"]
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log_path)
        print(f"\nradixmesh serve healthy after {time.perf_counter() - started:.1f} s")
        yield Server(url, proc, log_path)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _unique(text: str) -> str:
    return f"[{uuid.uuid4().hex[:8]}] {text}"


# ---- startup and listing -------------------------------------------------------------------------
def test_serve_prints_the_url(server: Server) -> None:
    expected = f"radixmesh: serving smollm2-135m-instruct on cpu at {server.url} (OpenAI API under /v1)"
    deadline = time.monotonic() + 10
    while expected not in server.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)  # /health may answer a moment before the line is printed
    assert expected in server.log_path.read_text()


def test_models(client: openai.OpenAI, model: str) -> None:
    assert model == "smollm2-135m-instruct"
    assert client.models.retrieve(model).id == model
    assert client.models.retrieve("smollm2-135m").id == model  # alias of the default model


# ---- OpenAI API ----------------------------------------------------------------------------------
def test_completion(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert out.object == "text_completion"
    assert "Paris" in out.choices[0].text
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage is not None and out.usage.prompt_tokens == 5
    assert 1 <= out.usage.completion_tokens <= 8


def test_chat(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=32)
    assert out.choices[0].message.role == "assistant"
    assert "Paris" in (out.choices[0].message.content or "")
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streaming_chat_concatenates_to_the_greedy_answer(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "system", "content": "Answer in one sentence."},
                {"role": "user", "content": "Why is the sky blue?"}]
    whole = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=48)
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=48,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert whole.usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n2(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(model=model, messages=QUESTION, n=2, temperature=1.0, seed=7,
                                         max_tokens=12)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.message.content for c in out.choices)
    assert out.usage is not None and out.usage.prompt_tokens < 60
    stream = client.completions.create(model=model, prompt="Once upon a time", n=2, max_tokens=6, temperature=1.0,
                                       seed=3, stream=True)
    texts = ["", ""]
    finished = set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and all(texts)


def test_stop(client: openai.OpenAI, model: str) -> None:
    greedy = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "." in greedy.choices[0].text
    out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
                                    stop=["."])
    assert out.choices[0].text == greedy.choices[0].text.split(".")[0]
    assert out.choices[0].finish_reason == "stop"


def test_logprobs(client: openai.OpenAI, model: str) -> None:
    chat = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=6,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert content is not None and len(content) == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the most likely token
    assert "".join(e.token for e in content) == chat.choices[0].message.content

    comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0,
                                     logprobs=2)
    lp = comp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert "".join(lp.tokens) == comp.choices[0].text
    assert len(lp.token_logprobs) == 4 and all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]


def test_usage_reports_cached_tokens_on_a_repeated_prefix(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": _unique("Summarize the plot of a long novel about the sea. " * 8)}]
    first = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=2)
    second = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=2)
    assert first.usage is not None and second.usage is not None
    first_cached = first.usage.prompt_tokens_details.cached_tokens
    second_cached = second.usage.prompt_tokens_details.cached_tokens
    assert first_cached is not None and second_cached is not None
    assert second_cached > first_cached
    assert second_cached >= second.usage.prompt_tokens - 1


def test_unknown_fields_are_ignored(server: Server, model: str) -> None:
    body = {"model": model, "messages": QUESTION, "max_tokens": 2, "user": "u-1", "store": False,
            "metadata": {"k": "v"}, "service_tier": "auto", "parallel_tool_calls": False, "some_new_field": 1}
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text


# ---- errors --------------------------------------------------------------------------------------
def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_malformed_json_is_400(server: Server) -> None:
    response = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", timeout=30,
                          headers={**server.headers, "Content-Type": "application/json"})
    assert _error(response, 400)["type"] == "invalid_request_error"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert info.value.code == "model_not_found" and info.value.param == "model"


@pytest.mark.parametrize(("field", "value"), [("temperature", -1.0), ("top_p", 0.0), ("n", 0),
                                              ("max_tokens", "many"), ("presence_penalty", 3.0),
                                              ("logit_bias", {"999999": 1.0}), ("top_logprobs", 50),
                                              ("response_format", {"type": "json_schema"})])
def test_invalid_parameter_is_400_naming_it(server: Server, model: str, field: str, value: Any) -> None:
    body = {"model": model, "messages": QUESTION, "max_tokens": 2, "logprobs": True, field: value}
    assert _error(server.post("/v1/chat/completions", body), 400)["param"] == field


def test_prompt_longer_than_the_context_is_400(server: Server, model: str) -> None:
    context_len = server.get("/v1/models").json()["data"][0]["max_model_len"]
    long_prompt = "hello " * (context_len + 10)
    error = _error(server.post("/v1/completions", {"model": model, "prompt": long_prompt}), 400)
    assert error["param"] == "prompt" and "context length" in error["message"]
    error = _error(server.post("/v1/chat/completions", {"model": model, "messages": [
        {"role": "user", "content": long_prompt}]}), 400)
    assert error["param"] == "messages"
    error = _error(server.post("/v1/chat/completions", {"model": model, "messages": QUESTION,
                                                        "max_tokens": context_len}), 400)
    assert error["param"] == "max_tokens"


def test_api_key_is_required(server: Server, model: str) -> None:
    body = {"model": model, "messages": QUESTION, "max_tokens": 2}
    assert _error(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30), 401)["code"] \
        == "invalid_api_key"
    wrong = {"Authorization": "Bearer sk-wrong"}
    _error(httpx.post(server.url + "/v1/chat/completions", json=body, headers=wrong, timeout=30), 401)
    _error(httpx.get(server.url + "/server_info", headers=wrong, timeout=30), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # probes stay open


def test_overload_is_429(server: Server, model: str) -> None:
    """Six open streams fill 4 running + 2 queued sequences; the next requests are refused at once."""
    long_story = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
                  "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with contextlib.ExitStack() as streams, httpx.Client(timeout=120, headers=server.headers) as http:
        for _ in range(6):
            response = streams.enter_context(http.stream("POST", server.url + "/v1/chat/completions",
                                                         json=long_story))
            assert response.status_code == 200
        assert server.server_info()["num_gateway_requests"] == 6
        refused = server.post("/v1/chat/completions", {"model": model, "messages": QUESTION, "max_tokens": 2})
        assert "overloaded" in _error(refused, 429)["message"]
        _error(server.post("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}), 429)
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0).completions.create(
                model=model, prompt="Hi", max_tokens=2)
    info = _wait_kv_free(server)  # closing the streams aborted them
    assert info["num_gateway_requests"] == 0 and info["kv_used_tokens"] == 0, info
    assert server.post("/v1/chat/completions", {"model": model, "messages": QUESTION, "max_tokens": 2}) \
        .status_code == 200


# ---- disconnects ---------------------------------------------------------------------------------
def _wait_kv_free(server: Server, timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        info = server.server_info()
        if (info["kv_used_tokens"], info["num_running_reqs"], info["num_waiting_reqs"]) == (0, 0, 0) \
                or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def test_disconnect_mid_stream_frees_the_kv(server: Server, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as http, \
            http.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers) as response:
        assert response.status_code == 200
        contents = 0
        for line in response.iter_lines():  # leaving this loop closes the connection (httpcore)
            if line.startswith("data: ") and '"content"' in line:
                contents += 1
            if contents >= 4:
                assert server.server_info()["kv_used_tokens"] > 0  # the request holds KV while it streams
                break
    info = _wait_kv_free(server)
    assert info["kv_used_tokens"] == 0 and info["num_running_reqs"] == 0, info


def test_disconnect_before_a_non_streamed_answer_frees_the_kv(server: Server, model: str) -> None:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=1.5)
    info = _wait_kv_free(server)
    assert info["kv_used_tokens"] == 0 and info["num_running_reqs"] == 0, info


# ---- native (SGLang) API -------------------------------------------------------------------------
def test_native_generate(server: Server) -> None:
    sampling = {"temperature": 0, "max_new_tokens": 8}
    by_text = server.post("/generate", {"text": "The capital of France is", "sampling_params": sampling,
                                        "return_logprob": True, "top_logprobs_num": 2})
    assert by_text.status_code == 200, by_text.text
    result = by_text.json()
    meta = result["meta_info"]
    assert "Paris" in result["text"] and meta["prompt_tokens"] == 5
    assert meta["completion_tokens"] == len(result["output_ids"]) == len(meta["output_token_logprobs"])
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["cached_tokens"] >= 0
    assert all(len(row) == 2 for row in meta["output_top_logprobs"])

    ids = server.post("/generate", {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 1}})
    by_ids = server.post("/generate", {"input_ids": [504, 3575, 282, 4649, 314], "sampling_params": sampling})
    assert by_ids.status_code == 200 and ids.status_code == 200
    assert by_ids.json()["meta_info"]["cached_tokens"] >= 4

    events = []
    with httpx.stream("POST", server.url + "/generate", headers=server.headers, timeout=60,
                      json={"text": "The capital of France is", "sampling_params": sampling, "stream": True}) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["text"] == result["text"] and last["meta_info"]["finish_reason"] is not None


def test_native_info_and_health(server: Server) -> None:
    assert server.get("/health").status_code == 200
    assert server.get("/health_generate").status_code == 200
    for path in ("/model_info", "/get_model_info"):
        info = server.get(path).json()
        assert Path(info["model_path"]).is_dir() and info["is_generation"] is True
    for path in ("/server_info", "/get_server_info"):
        info = server.get(path).json()
        for key in ("kv_used_tokens", "max_total_num_tokens", "num_running_reqs", "num_waiting_reqs", "model_path"):
            assert key in info, key


def test_flush_cache_and_abort_request(server: Server) -> None:
    assert server.post("/flush_cache").status_code == 200
    assert server.server_info()["kv_cached_tokens"] == 0
    rid = f"rid-{uuid.uuid4().hex}"
    body = {"text": "Once upon a time", "rid": rid, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}

    async def abort_while_running() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as http:
            pending = asyncio.ensure_future(http.post("/generate", json=body))
            deadline = time.monotonic() + 60
            while (await http.get("/server_info")).json()["num_running_reqs"] == 0:  # an early abort finds nothing
                assert time.monotonic() < deadline, "the request never started"
                await asyncio.sleep(0.05)
            aborted = await http.post("/abort_request", json={"rid": rid})
            assert aborted.status_code == 200
            return await pending

    result = asyncio.run(abort_while_running())
    assert result.status_code == 200, result.text
    meta = result.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["id"] == rid
    assert meta["completion_tokens"] < 2000


# ---- metrics -------------------------------------------------------------------------------------
def _scrape(server: Server) -> dict[str, float]:
    response = httpx.get(server.url + "/metrics", timeout=30)  # open without the API key
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        assert family.name.startswith(("radixmesh_", "vllm:")), family.name  # vllm: the model-server protocol's
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("service", None) == "serve", f"{sample.name} lacks service=\"serve\""
            key = sample.name + json.dumps(labels, sort_keys=True) if labels else sample.name
            samples[key] = sample.value
    return samples


def test_metrics_parse_and_move(server: Server, client: openai.OpenAI, model: str) -> None:
    before = _scrape(server)
    client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=8)
    after = _scrape(server)
    for name in ("radixmesh_prompt_tokens_total", "radixmesh_generation_tokens_total",
                 "radixmesh_time_to_first_token_seconds_count", "radixmesh_e2e_request_latency_seconds_count",
                 "radixmesh_inter_token_latency_seconds_count", "radixmesh_ttft_overhead_seconds_count"):
        assert after[name] > before.get(name, 0.0), name
    chat_requests = 'radixmesh_requests_total{"endpoint": "chat_completions"}'
    assert after[chat_requests] == before.get(chat_requests, 0.0) + 1
    for gauge in ("radixmesh_num_running_requests", "radixmesh_num_queued_requests",
                  "radixmesh_kv_cache_usage_ratio", "radixmesh_cache_hit_rate"):
        assert gauge in after, gauge
    assert after["radixmesh_kv_capacity_tokens"] > 0
