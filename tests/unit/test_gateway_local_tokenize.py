"""`radixmesh gateway --tokenize local`: text and chat prompts encoded in the gateway with its copy of the tokenizer
service's tokenizer give the service's token ids, prompt text and block hashes, without a Tokenize call; prompts
go to the service with `--tokenize service`, and while (or when) the copy cannot be loaded."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.hf_tokenizer import load_tokenizer
from radixmesh.gateway.cluster_backend import ClusterBackend
from radixmesh.gateway.tokenizer_upstream import TokenizerUpstream
from radixmesh.protocol import tokenizer_pb2
from radixmesh.tokenizer_service.service import TokenizerServicer
from tests.unit.test_split_encode import prompts

BLOCK_SIZE = 16
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]
CHATS: list[tuple[list[dict[str, Any]], Any]] = [
    ([{"role": "user", "content": "Hello there, how are you?"}], None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three primes."},
      {"role": "assistant", "content": "2, 3, 5."}, {"role": "user", "content": "And three more?"}], None),
    ([{"role": "user", "content": "Weather in Oslo?"},
      {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "get_weather",
                                                            "arguments": "{\"city\": \"Oslo\"}"}]},
      {"role": "tool", "content": "{\"temp\": 3}", "tool_call_id": "c1", "name": "get_weather"}], TOOLS),
]


class _Service:
    """The tokenizer service's stub, answered in process by a real `TokenizerServicer`; counts Tokenize calls."""

    def __init__(self, servicer: TokenizerServicer, files_fail: bool = False) -> None:
        self.servicer, self.files_fail, self.tokenize_calls = servicer, files_fail, 0

    async def Tokenize(self, request: Any, timeout: float) -> tokenizer_pb2.TokenizeResponse:
        self.tokenize_calls += 1
        response: tokenizer_pb2.TokenizeResponse = await TokenizerServicer.Tokenize.__wrapped__(  # type: ignore
            self.servicer, request, None)
        return response

    async def GetTokenizerFiles(self, request: Any, timeout: float) -> tokenizer_pb2.GetTokenizerFilesResponse:
        if self.files_fail:
            raise invalid_argument("no files today", "files")
        response: tokenizer_pb2.GetTokenizerFilesResponse = await TokenizerServicer.GetTokenizerFiles.__wrapped__(  # type: ignore
            self.servicer, request, None)
        return response


@pytest.fixture(scope="module")
def servicer(default_model_dir: Path) -> Any:
    servicer = TokenizerServicer(load_tokenizer(str(default_model_dir)), "m", block_size=BLOCK_SIZE)
    yield servicer
    servicer.pool.close()


def _upstream(service: _Service, tokenize_locally: bool) -> TokenizerUpstream:
    upstream = TokenizerUpstream("127.0.0.1:1", tokenize_locally=tokenize_locally, detokenize_locally=False,
                                 tokenizer_workers=4)  # nothing is dialled: the stub below answers
    upstream.group.upstreams[0].stub = service
    upstream.block_size = BLOCK_SIZE
    return upstream


def test_local_prompts_equal_the_services_ids_text_and_hashes(servicer: TokenizerServicer) -> None:
    texts = prompts(servicer.tokenizer, 12, seed=11)  # random-token text up to 2,500 tokens (cut in pieces), prose
    assert max(len(t) for t in texts) > 8192

    async def run() -> None:
        service = _Service(servicer)
        local, remote = _upstream(service, True), _upstream(_Service(servicer), False)
        await local.fetch_local_tokenizer()
        assert local.pool is not None and local.local_tokenizer is None  # detokenizing stays with the service
        for text in texts:
            ids = await local.encode(text)
            assert ids == await remote.encode(text)
            assert local.prompt_hashes(ids) == remote.prompt_hashes(ids)
            assert len(local.prompt_hashes(ids).hashes) == len(ids) // BLOCK_SIZE
        for messages, tools in CHATS:
            for add_prompt in (True, False):
                mine = await local.chat(messages, add_prompt, tools)
                theirs = await remote.chat(messages, add_prompt, tools)
                assert (list(mine.token_ids), mine.prompt_text) == (list(theirs.token_ids), theirs.prompt_text)
                assert list(mine.block_hashes.hashes) == list(theirs.block_hashes.hashes)
                assert local.prompt_hashes(list(mine.token_ids)) == remote.prompt_hashes(list(theirs.token_ids))
        assert service.tokenize_calls == 0
        assert remote.group.upstreams[0].stub.tokenize_calls == len(texts) + 2 * len(CHATS)
        local.close()
        remote.close()

    asyncio.run(run())


def test_the_service_tokenizes_when_asked_or_when_the_copy_fails(servicer: TokenizerServicer) -> None:
    async def run() -> None:
        for tokenize_locally, files_fail in ((False, False), (True, True)):
            service = _Service(servicer, files_fail)
            upstream = _upstream(service, tokenize_locally)
            if tokenize_locally:
                await upstream.fetch_local_tokenizer()  # the copy fails: logged, the service tokenizes
            assert upstream.pool is None
            ids = await upstream.encode("Hello world, once more.")
            assert ids == servicer.tokenizer.encode("Hello world, once more.") and service.tokenize_calls == 1
            response = await upstream.chat(CHATS[0][0], True)
            assert list(response.token_ids) and service.tokenize_calls == 2
            upstream.close()

    asyncio.run(run())


def test_the_gateway_flag_is_checked_and_reported() -> None:
    async def run() -> None:
        backend = ClusterBackend("127.0.0.1:1", "127.0.0.1:2", tokenize="service")
        assert not backend.tokenizer.tokenize_locally and backend.tokenizer.detokenize_locally
        assert backend.readiness_details()["tokenize"] == "service"
        await backend.close()
        backend = ClusterBackend("127.0.0.1:1", "127.0.0.1:2")  # default: local, once the copy is loaded
        assert backend.tokenizer.tokenize_locally and backend.tokenizer.wants_copy
        await backend.close()

    asyncio.run(run())
    with pytest.raises(Exception, match="tokenize must be one of local, service"):
        ClusterBackend("127.0.0.1:1", "127.0.0.1:2", tokenize="psychic")

