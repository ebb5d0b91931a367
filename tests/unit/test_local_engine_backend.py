"""`radixmesh serve`'s gateway backend (gateway/local_backend.py) over a stand-in engine client: the model card,
tokenization in this process, text assembled from the scheduler's outputs (with the engine's share of the time to
first token), and the calls it passes through."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

import pytest

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.loader.default_model import DEFAULT_MODEL_ALIASES, DEFAULT_MODEL_NAME
from radixmesh.gateway.local_backend import LocalEngineBackend
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.sampling import SamplingParams

from .test_detokenizer import byte_level_tokenizer


class FakeClient:
    """Stands in for EngineClient: a prepared model, a tokenizer (or none), and outputs for a generate."""

    def __init__(self, tokenizer: Any = None, name: str = "tiny", model_path: str | None = "/models/tiny",
                 outputs: list[TokenOut] | None = None) -> None:
        self.tokenizer = tokenizer
        self.prepared = SimpleNamespace(config=SimpleNamespace(is_multimodal=False, architecture="LlamaForCausalLM",
                                                               raw={}),
                                        model_path=model_path, tokenizer_path="/tok/tiny" if tokenizer else None,
                                        name=name)
        self.config = EngineConfig(device="cpu", model="tiny-model", max_running_requests=6)
        self.server_info = {"max_running_requests": 4}
        self.context_len = 128
        self.model_config = SimpleNamespace(vocab_size=500)
        self.is_alive = True
        self.outputs = outputs or []
        self.log: list[str] = []

    def validate(self, input_ids: list[int], params: SamplingParams, mm: Any = None, lora: Any = None) -> None:
        self.log.append(f"validate {len(input_ids)}")

    async def generate_tokens(self, input_ids: list[int], params: SamplingParams, rid: str,
                              mm: Any = None, lora: Any = None) -> AsyncGenerator[TokenOut, None]:
        self.log.append(f"generate {rid}")
        for out in self.outputs:
            await asyncio.sleep(0.001)
            yield out

    async def cache_prefix(self, input_ids: list[int], mm: Any = None, lora: Any = None) -> None:
        self.log.append("cache_prefix")

    def branch_params(self, params: SamplingParams) -> list[SamplingParams]:
        return [params] * params.n

    async def abort(self, rid: str) -> None:
        self.log.append(f"abort {rid}")

    async def flush_cache(self) -> bool:
        return True

    async def get_server_info(self) -> dict[str, Any]:
        return {"num_running_reqs": 0}

    async def shutdown(self) -> None:
        self.log.append("shutdown")


def backend(client: FakeClient, served: str | None = None) -> LocalEngineBackend:
    return LocalEngineBackend(client, served)  # type: ignore[arg-type]


def test_the_card_names_the_model_and_its_aliases() -> None:
    card = backend(FakeClient(name="tiny", model_path="/models/tiny-dir"), served="served").card
    assert card.name == "served" and {"tiny", "tiny-model", "/models/tiny-dir", "tiny-dir"} <= card.aliases
    assert (card.context_len, card.vocab_size, card.max_running_requests) == (128, 500, 4)
    assert card.extra["backend"] == "local" and card.extra["device"] == "cpu" and not card.has_image_understanding
    assert card.accepts("tiny-dir") and not card.accepts("other")


def test_the_default_model_answers_to_its_aliases() -> None:
    card = backend(FakeClient(name=DEFAULT_MODEL_NAME)).card
    assert card.name == DEFAULT_MODEL_NAME and DEFAULT_MODEL_ALIASES - {DEFAULT_MODEL_NAME} <= card.aliases


def test_without_a_tokenizer_text_is_refused_naming_the_field_and_ids_read_as_numbers() -> None:
    b = backend(FakeClient(tokenizer=None))
    assert not b.has_tokenizer
    for call, param in ((lambda: b.encode("hi"), "prompt"),
                        (lambda: b.apply_chat_template([{"role": "user", "content": "hi"}]), "messages")):
        with pytest.raises(RadixMeshError) as info:
            asyncio.run(call())
        assert info.value.param == param
    assert b.token_texts([5, 6]) == ["<5>", "<6>"]


def test_text_is_tokenized_and_detokenized_here() -> None:
    tokenizer = byte_level_tokenizer()
    b = backend(FakeClient(tokenizer=tokenizer))
    ids = asyncio.run(b.encode("hello world"))
    assert b.has_tokenizer and b.decode(ids) == "hello world" and "".join(b.token_texts(ids)) == "hello world"


def test_a_generate_assembles_text_and_reports_the_engines_share_of_the_first_token() -> None:
    tokenizer = byte_level_tokenizer()
    ids = list(tokenizer.encode("the quick fox", add_special_tokens=False))
    outputs = [TokenOut("g", [i], 4, 1, n + 1) for n, i in enumerate(ids[:-1])]
    outputs.append(TokenOut("g", ids[-1:], 4, 1, len(ids), finish_reason="length"))
    client = FakeClient(tokenizer=tokenizer, outputs=outputs)
    b = backend(client)

    async def run() -> list[Any]:
        return [chunk async for chunk in b.generate([1, 2, 3, 4], SamplingParams(), rid="g")]

    chunks = asyncio.run(run())
    assert "".join(c.text for c in chunks) == "the quick fox" and chunks[-1].finish_reason == "length"
    assert chunks[0].engine_ttft_s is not None and chunks[0].engine_ttft_s > 0
    assert all(c.engine_ttft_s is None for c in chunks[1:])  # the first chunk only
    assert client.log == ["generate g"]


def test_calls_pass_through_to_the_engine_client_and_close_once() -> None:
    client = FakeClient()
    b = backend(client)
    b.validate([1, 2], SamplingParams())
    assert b.branch_params(SamplingParams(n=2)) == [SamplingParams(n=2)] * 2

    async def run() -> tuple[bool, dict[str, Any]]:
        await b.cache_prefix([1, 2])
        await b.abort("x")
        flushed, info = await b.flush_cache(), await b.server_info()
        await b.close()
        await b.close()
        return flushed, info

    assert asyncio.run(run()) == (True, {"num_running_reqs": 0})
    assert client.log == ["validate 2", "cache_prefix", "abort x", "shutdown"]
    assert not b.is_healthy


def test_a_text_only_model_refuses_images_by_name() -> None:
    from radixmesh.engine.mm.prompt import PromptWithImages
    from radixmesh.wire.images import ImageSource

    b = backend(FakeClient())
    with pytest.raises(RadixMeshError) as info:
        asyncio.run(b.tokenize_multimodal(PromptWithImages([ImageSource("image_data", url="data:,")], text="hi")))
    assert "tiny" in info.value.message
