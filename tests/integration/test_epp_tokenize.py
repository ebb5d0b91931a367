"""The endpoint picker's tokens: its copy of the tokenizer service's tokenizer gives the service's own token ids and
block hashes (so the picker looks up the blocks the workers publish), and it calls the service until the copy is in."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from radixmesh.router.epp.prompt import PromptInput, prompt_of
from radixmesh.router.epp.tokens import PromptTokenizer
from tests.integration.service_procs import ServiceProc, start_service

pytestmark = pytest.mark.integration

PROMPTS = [
    prompt_of(b'{"prompt": "The capital of France is"}'),
    prompt_of(b'{"text": "na\\u00efve caf\\u00e9 \\u4f60\\u597d"}'),
    prompt_of(b'{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}'),
    prompt_of(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
              b'{"type": "text", "text": "b"}]}, {"role": "assistant", "content": "c"}, '
              b'{"role": "user", "content": "d"}]}'),
    PromptInput("text", text="word " * 5000),  # long: tokenized in a thread
]


@pytest.fixture(scope="module")
def tokenizer() -> Iterator[ServiceProc]:
    service = start_service("tokenizer", ["--metrics-port", "-1"])
    yield service
    service.stop()


def test_the_local_copy_tokenizes_as_the_service_does(tokenizer: ServiceProc) -> None:
    async def run() -> None:
        local = PromptTokenizer(tokenizer.address, 16, 10.0, "local")
        service = PromptTokenizer(tokenizer.address, 16, 10.0, "service")
        first = await local.tokens(PROMPTS[0])
        assert first.source == "tokenized-service"  # the copy is not in yet: the service answers
        local.start()
        for _ in range(600):
            if local.local is not None:
                break
            await asyncio.sleep(0.05)
        assert local.local is not None, "the tokenizer was never copied"
        for prompt in PROMPTS:
            here, there = await local.tokens(prompt), await service.tokens(prompt)
            assert (here.source, there.source) == ("tokenized", "tokenized-service")
            assert here.num_tokens == there.num_tokens > 0 and here.block_hashes == there.block_hashes, prompt
        assert first.block_hashes == (await local.tokens(PROMPTS[0])).block_hashes
        await local.close()
        await service.close()

    asyncio.run(run())


def test_a_tokenizer_that_is_down_costs_the_lookup_not_the_request() -> None:
    async def run() -> None:
        down = PromptTokenizer("127.0.0.1:1", 16, 0.5, "service")
        tokens = await down.tokens(PROMPTS[2])
        assert tokens.source == "tokenizer-error" and tokens.num_tokens == 0
        ids = await down.tokens(PromptInput("ids", token_ids=tuple(range(40))))
        assert ids.source == "token-ids" and len(ids.block_hashes) == 2
        await down.close()

    asyncio.run(run())
