"""The HTTP layer over a scripted fake backend: shapes, errors, admission and aborts, no model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from radixmesh.common.errors import ErrorCode, RadixMeshError, invalid_argument
from radixmesh.engine.sampling.validation import validate_params
from radixmesh.gateway.app import create_app
from radixmesh.gateway.backend import GatewayBackend, GenerationChunk, ModelCard, SamplingParams
from radixmesh.gateway.config import GatewayConfig
from radixmesh.gateway.dispatch import Dispatcher, PromptJob
from radixmesh.gateway.errors import to_http
from radixmesh.gateway.metrics import GatewayMetrics

VOCAB = 100
CONTEXT_LEN = 64


class FakeBackend(GatewayBackend):
    """Each character is one token (ord % VOCAB); output token i is `i % 26` and reads as a letter."""

    def __init__(self, delay_s: float = 0.0, max_running_requests: int = 2) -> None:
        self._card = ModelCard(name="fake-model", aliases=frozenset({"fake"}), model_path="/models/fake",
                               tokenizer_path="/models/fake", context_len=CONTEXT_LEN, vocab_size=VOCAB,
                               max_running_requests=max_running_requests, created=0)
        self.delay_s = delay_s
        self.aborted: list[str] = []
        self.cached_prefixes: list[list[int]] = []
        self.seen_params: list[SamplingParams] = []
        self.seen_chats: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = []
        self._abort_requested: set[str] = set()
        self._seen_prompts: set[tuple[int, ...]] = set()

    @property
    def card(self) -> ModelCard:
        return self._card

    @property
    def is_healthy(self) -> bool:
        return True

    async def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    async def apply_chat_template(self, messages: list[dict[str, Any]],
                                  tools: list[dict[str, Any]] | None = None) -> list[int]:
        self.seen_chats.append((messages, tools))
        return await self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(97 + t % 26) for t in token_ids)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        return [chr(97 + t % 26) for t in token_ids]

    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        validate_params(params, VOCAB)
        if len(input_ids) >= CONTEXT_LEN:
            raise invalid_argument("the prompt is too long", "prompt")

    async def generate(self, input_ids: list[int], params: SamplingParams,
                       rid: str | None = None) -> AsyncGenerator[GenerationChunk, None]:
        rid = rid or "rid"
        self.seen_params.append(params)
        cached = len(input_ids) - 1 if tuple(input_ids) in self._seen_prompts else 0
        self._seen_prompts.add(tuple(input_ids))
        finished = False
        try:
            for i in range(params.max_new_tokens):
                await asyncio.sleep(self.delay_s)
                if rid in self._abort_requested:
                    finished = True
                    yield GenerationChunk(rid, "", [], len(input_ids), cached, i, finish_reason="abort")
                    return
                done = i + 1 == params.max_new_tokens
                finished = done
                top = [[(i % 26, -0.1), ((i + 1) % 26, -2.0)][:params.top_logprobs]] if params.logprobs else None
                yield GenerationChunk(rid, chr(97 + i % 26), [i % 26], len(input_ids), cached, i + 1,
                                      [-0.1] if params.logprobs else None, top, "length" if done else None)
        finally:
            if not finished:
                self.aborted.append(rid)

    async def cache_prefix(self, input_ids: list[int]) -> None:
        self.cached_prefixes.append(list(input_ids))
        self._seen_prompts.add(tuple(input_ids))

    def branch_params(self, params: SamplingParams) -> list[SamplingParams]:
        return [msgspec.structs.replace(params, n=1) for _ in range(params.n)]

    async def abort(self, rid: str) -> None:
        self._abort_requested.add(rid)

    async def flush_cache(self) -> bool:
        return True

    async def server_info(self) -> dict[str, Any]:
        return {"num_running_reqs": 0, "num_waiting_reqs": 0, "kv_used_tokens": 0, "kv_usage": 0.0,
                "max_total_num_tokens": 1000, "cache_hit_rate": 0.0}

    async def close(self) -> None:
        pass


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def http(backend: FakeBackend) -> Iterator[TestClient]:
    with TestClient(create_app(backend, GatewayConfig())) as client:
        yield client


def _sse(text: str) -> list[Any]:
    frames = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


# ---- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("code", "status"), [
    (ErrorCode.INVALID_ARGUMENT, 400), (ErrorCode.UNSUPPORTED, 400), (ErrorCode.NOT_FOUND, 404),
    (ErrorCode.UNAUTHENTICATED, 401), (ErrorCode.RESOURCE_EXHAUSTED, 429), (ErrorCode.UNAVAILABLE, 503),
    (ErrorCode.ABORTED, 499), (ErrorCode.INTERNAL, 500)])
def test_every_error_code_has_a_status_and_an_openai_body(code: ErrorCode, status: int) -> None:
    got_status, body = to_http(RadixMeshError(code, "boom", "temperature"))
    assert got_status == status
    assert body == {"error": {"message": "boom", "type": body["error"]["type"], "param": "temperature",
                              "code": body["error"]["code"]}}


def test_request_errors(http: TestClient) -> None:
    bad_json = http.post("/v1/completions", content=b"{", headers={"Content-Type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    not_object = http.post("/v1/completions", json=[1, 2])
    assert not_object.status_code == 400
    unknown_model = http.post("/v1/chat/completions", json={"model": "gpt-4", "messages": [
        {"role": "user", "content": "hi"}]})
    assert unknown_model.status_code == 404 and unknown_model.json()["error"]["code"] == "model_not_found"
    assert http.get("/v1/models/fake").status_code == 200 and http.get("/v1/models/nope").status_code == 404
    no_route = http.get("/v2/nothing")
    assert no_route.status_code == 404 and "error" in no_route.json()


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ({"prompt": "hi", "logprobs": 30}, "logprobs"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "x" * CONTEXT_LEN}, "prompt"),
    ({"prompt": "hi", "max_tokens": CONTEXT_LEN}, "max_tokens"),
    ({"prompt": "hi", "suffix": "!"}, "suffix"),
    ({"prompt": []}, "prompt"),
])
def test_completion_parameter_errors_name_the_openai_field(http: TestClient, body: dict[str, Any],
                                                           param: str) -> None:
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(("body", "param"), [
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x" * CONTEXT_LEN}]}, "messages"),
    ({"messages": []}, "messages"),
])
def test_chat_parameter_errors_name_the_openai_field(http: TestClient, body: dict[str, Any], param: str) -> None:
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_api_key(backend: FakeBackend) -> None:
    with TestClient(create_app(backend, GatewayConfig(api_key="k"))) as client:
        body = {"prompt": "hi", "max_tokens": 1}
        missing = client.post("/v1/completions", json=body)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer x"}).status_code == 401
        assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer k"}).status_code == 200
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


# ---- OpenAI shapes -------------------------------------------------------------------------------
def test_completion_with_logprobs_and_usage(http: TestClient, backend: FakeBackend) -> None:
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": 3, "logprobs": 2, "temperature": 0,
            "user": "ignored", "store": False}
    out = http.post("/v1/completions", json=body).json()
    choice = out["choices"][0]
    assert choice["text"] == "abc" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["a", "b", "c"] and choice["logprobs"]["text_offset"] == [0, 1, 2]
    assert choice["logprobs"]["top_logprobs"][0] == {"a": -0.1, "b": -2.0}
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    again = http.post("/v1/completions", json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 4
    assert backend.seen_params[0].temperature == 0 and backend.seen_params[0].top_logprobs == 2


def test_batched_prompts_and_echo(http: TestClient) -> None:
    out = http.post("/v1/completions", json={"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 2, "n": 2,
                                             "echo": True}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["choices"][2]["text"] == "def" + "ab"
    assert out["usage"]["prompt_tokens"] == 5 and out["usage"]["completion_tokens"] == 8


def test_chat_n2_shares_the_prompt(http: TestClient, backend: FakeBackend) -> None:
    out = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                                  "max_tokens": 2, "logprobs": True, "top_logprobs": 1}).json()
    assert [c["message"]["content"] for c in out["choices"]] == ["ab", "ab"]
    assert len(backend.cached_prefixes) == 1
    entry = out["choices"][0]["logprobs"]["content"][0]
    assert entry == {"token": "a", "logprob": -0.1, "bytes": [97],
                     "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]}]}
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == out["usage"]["prompt_tokens"] - 1


def test_chat_stream(http: TestClient) -> None:
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [
        {"type": "text", "text": "hi"}]}], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(response.read().decode())
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "abc"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)


def test_models(http: TestClient) -> None:
    data = http.get("/v1/models").json()["data"]
    assert data[0]["id"] == "fake-model" and data[0]["max_model_len"] == CONTEXT_LEN


# ---- native API ----------------------------------------------------------------------------------
def test_native_generate(http: TestClient) -> None:
    out = http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2},
                                       "return_logprob": True, "top_logprobs_num": 1, "rid": "r1"}).json()
    assert out["text"] == "ab" and out["output_ids"] == [0, 1]
    meta = out["meta_info"]
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "length", "length": 2}
    assert meta["output_token_logprobs"] == [[-0.1, 0, None], [-0.1, 1, None]]
    batch = http.post("/generate", json={"text": ["ab", "cd"], "sampling_params": {"max_new_tokens": 1}}).json()
    assert isinstance(batch, list) and len(batch) == 2
    with http.stream("POST", "/generate", json={"text": "ab", "stream": True,
                                                "sampling_params": {"max_new_tokens": 3}}) as response:
        events = _sse(response.read().decode())
    assert [e["text"] for e in events] == ["a", "ab", "abc"]  # cumulative, as SGLang streams
    bad = http.post("/generate", json={"text": "a", "sampling_params": {"structural_tag": "{}", "max_new_tokens": 2}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "structural_tag"


def test_native_stream_events_encode_what_json_dumps_would() -> None:
    """The cumulative text and ids are encoded as they grow; each event must read as json.dumps of the
    whole result would write it (quotes, escapes, non-ASCII and astral characters, batch index)."""
    from radixmesh.gateway.native_api import _GrowingJson
    from radixmesh.gateway.openai_convert import ChoiceState

    pieces = ['He said "hi"', "\n\t\\", "caf\u00e9 ", "\U0001f600", "", "\u2028end", "</script>"]
    st, encoded = ChoiceState(), _GrowingJson()
    for i, piece in enumerate(pieces):
        st.add(GenerationChunk("r", piece, [i, 1000 + i] if i % 3 else [], 5, 0, len(st.token_ids)))
        text, ids = encoded.update(st)
        assert text == json.dumps(st.text) and ids == json.dumps(st.token_ids)
    assert json.loads(text) == "".join(pieces)


def test_native_stream_batch_events_carry_the_index(http: TestClient) -> None:
    body = {"text": ["ab", "cd"], "stream": True, "sampling_params": {"max_new_tokens": 2}}
    with http.stream("POST", "/generate", json=body) as response:
        events = _sse(response.read().decode())
    assert sorted((e["index"], e["text"], e["output_ids"]) for e in events) == [
        (0, "a", [0]), (0, "ab", [0, 1]), (1, "a", [0]), (1, "ab", [0, 1])]
    assert all(set(e) == {"text", "output_ids", "meta_info", "index"} for e in events)


def test_native_info_routes(http: TestClient) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    assert http.get("/get_model_info").json()["model_path"] == "/models/fake"
    assert http.get("/server_info").json()["kv_used_tokens"] == 0
    assert http.post("/flush_cache").status_code == 200
    assert http.post("/abort_request", json={"rid": "nothing"}).status_code == 200
    families = {f.name for f in text_string_to_metric_families(http.get("/metrics").text)}
    assert {"radixmesh_requests", "radixmesh_time_to_first_token_seconds", "radixmesh_kv_cache_usage_ratio"} \
        <= families


# ---- admission and aborts ------------------------------------------------------------------------
def _dispatcher(backend: FakeBackend, max_queued: int | None) -> Dispatcher:
    return Dispatcher(backend, GatewayMetrics("fake-model"), max_queued)


def test_admission_limit_counts_sequences_and_releases_them() -> None:
    backend = FakeBackend(max_running_requests=2)
    dispatcher = _dispatcher(backend, max_queued=1)
    params = SamplingParams(max_new_tokens=2, n=2)
    first = dispatcher.open("chat", [PromptJob([1, 2], params)])
    with pytest.raises(RadixMeshError) as info:
        dispatcher.open("chat", [PromptJob([1, 2], params)])
    assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED
    single = dispatcher.open("chat", [PromptJob([1, 2], SamplingParams(max_new_tokens=1))])
    asyncio.run(first.aclose())
    asyncio.run(single.aclose())
    assert dispatcher.num_in_flight == 0 and not dispatcher.active


def test_closing_a_stream_early_aborts_every_sequence() -> None:
    backend = FakeBackend(delay_s=0.01)
    dispatcher = _dispatcher(backend, max_queued=None)

    async def run() -> list[str]:
        generation = dispatcher.open("chat", [PromptJob([1, 2], SamplingParams(max_new_tokens=50, n=3))])
        async for _index, chunk in generation.stream():
            assert chunk.text
            break
        await generation.aclose()
        return generation.rids

    rids = asyncio.run(run())
    assert sorted(backend.aborted) == sorted(rids) and len(rids) == 3
    assert dispatcher.num_in_flight == 0


def test_abort_request_finishes_with_abort() -> None:
    backend = FakeBackend(delay_s=0.01)
    dispatcher = _dispatcher(backend, max_queued=None)

    async def run() -> list[str | None]:
        generation = dispatcher.open("generate", [PromptJob([1], SamplingParams(max_new_tokens=1000))], "req-1")
        reasons = []
        async for _index, chunk in generation.stream():
            if chunk.completion_tokens == 2:
                await dispatcher.abort("req-1")
            reasons.append(chunk.finish_reason)
        await generation.aclose()
        return reasons

    reasons = asyncio.run(run())
    assert reasons[-1] == "abort" and len(reasons) < 10
    assert not backend.aborted  # finished by the backend, not cut off by the gateway


def test_a_dead_engine_is_503() -> None:
    class DeadBackend(FakeBackend):
        @property
        def is_healthy(self) -> bool:
            return False

    with TestClient(create_app(DeadBackend(), GatewayConfig())) as client:
        assert client.get("/health").status_code == 503
        response = client.post("/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 503 and response.json()["error"]["type"] == "server_error"
        assert client.get("/metrics").status_code == 200  # still scrapeable


def test_gateway_config_bounds() -> None:
    with pytest.raises(RadixMeshError):
        GatewayConfig(port=70000)
    with pytest.raises(RadixMeshError):
        GatewayConfig(max_queued_requests=-1)
    assert GatewayConfig(host="::1").url(9000) == "http://[::1]:9000"
