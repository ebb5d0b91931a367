"""`radixmesh serve`'s front end tokenizes each text prompt once, off its event loop, hands the engine exactly
the tokenizer's ids, and reports the time in `Server-Timing` and `radixmesh_tokenize_seconds`."""

from __future__ import annotations

import threading
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from radixmesh.engine.client import EngineClient
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.hf_tokenizer import encode_chat, encode_text, load_tokenizer
from radixmesh.engine.loader import prepare_model
from radixmesh.gateway.app import create_app
from radixmesh.gateway.config import GatewayConfig
from radixmesh.gateway.local_backend import LocalEngineBackend
from radixmesh.wire.messages import TokenOut
from tests.unit.test_tokenize_pool import CountingEncoder, random_text


class ScriptedEngineClient(EngineClient):
    """The real client's validation and bookkeeping, with a scheduler that answers each prompt with one token
    and records the ids it was given."""

    def __init__(self, prepared: Any, tokenizer: Any) -> None:
        super().__init__(EngineConfig(device="cpu"), prepared, tokenizer)
        self._ctx.destroy(linger=0)  # no scheduler process: its sockets are never used
        self.server_info = {"max_running_requests": 8}
        self.prompts: list[list[int]] = []

    @property
    def is_alive(self) -> bool:
        return True

    async def _stream(self, msg: Any) -> AsyncGenerator[Any, None]:
        self.prompts.append(list(msg.input_ids))
        yield TokenOut(msg.rid, [42], len(msg.input_ids), 0, 1, finish_reason="length")

    async def get_server_info(self) -> dict[str, Any]:
        return dict(self.server_info)

    async def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    return load_tokenizer(default_model_dir)


@pytest.fixture
def serve(default_model_dir: Path, tokenizer: Any) -> Iterator[tuple[TestClient, LocalEngineBackend, CountingEncoder]]:
    prepared = prepare_model(str(default_model_dir), need_weights=False)
    backend = LocalEngineBackend(ScriptedEngineClient(prepared, tokenizer), tokenizer_workers=2)
    assert backend.tokenize_pool is not None
    counter = CountingEncoder(backend.tokenize_pool)
    with TestClient(create_app(backend, GatewayConfig())) as http:
        yield http, backend, counter


def _engine_prompts(backend: LocalEngineBackend) -> list[list[int]]:
    client = backend.client
    assert isinstance(client, ScriptedEngineClient)
    return client.prompts


def test_a_text_prompt_is_encoded_once_off_the_loop(serve: Any, tokenizer: Any) -> None:
    http, backend, counter = serve
    text = random_text(tokenizer, 3000, seed=3)
    reply = http.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}, "stream": True})
    assert reply.status_code == 200, reply.text
    assert counter.texts == [text]
    assert threading.main_thread().ident not in counter.threads
    assert _engine_prompts(backend) == [encode_text(tokenizer, text)]
    name, _, duration = reply.headers["server-timing"].partition(";dur=")
    assert name == "tokenize" and float(duration) > 0
    metrics = http.get("/metrics").text
    assert 'radixmesh_tokenize_seconds_count{service="serve"} 1.0' in metrics


def test_every_text_path_encodes_once_per_prompt(serve: Any, tokenizer: Any) -> None:
    http, backend, counter = serve
    texts = ["first prompt", "second prompt", "third"]
    assert http.post("/v1/completions", json={"prompt": texts, "max_tokens": 1}).status_code == 200
    assert http.post("/generate", json={"text": texts[:2], "sampling_params": {"max_new_tokens": 1}}) \
        .status_code == 200
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert chat.status_code == 200 and chat.headers["server-timing"].startswith("tokenize;dur=")
    assert sorted(counter.texts[:5]) == sorted(texts + texts[:2])
    assert len(counter.texts) == 6  # the conversation, rendered, is the sixth text
    expected = [encode_text(tokenizer, t) for t in texts + texts[:2]] + [encode_chat(tokenizer, messages)]
    assert sorted(_engine_prompts(backend)) == sorted(expected)


def test_token_id_prompts_are_not_tokenized(serve: Any) -> None:
    http, backend, counter = serve
    reply = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}})
    assert reply.status_code == 200
    assert counter.texts == [] and "server-timing" not in reply.headers
    assert _engine_prompts(backend) == [[5, 6, 7]]
