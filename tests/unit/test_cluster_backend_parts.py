"""The cluster gateway's backend by its parts (gateway/tokenizer_upstream.py, model_card.py, cluster_backend.py;
the Generate upstream is test_generate_upstream.py), over stand-ins: the prompts' block hashes, the model card, the
checks made before anything is sent, and a generate through the parts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.common.readiness import Readiness
from radixmesh.gateway import model_card as card_module
from radixmesh.gateway import tokenizer_upstream
from radixmesh.gateway.backend import ModelCard
from radixmesh.gateway.cluster_backend import ClusterBackend
from radixmesh.gateway.model_card import ModelCardReader
from radixmesh.gateway.tokenizer_upstream import TokenizerUpstream
from radixmesh.gateway.upstreams import UpstreamGroup
from radixmesh.protocol import common_pb2, tokenizer_pb2, worker_pb2
from radixmesh.wire.block_hash import block_hashes
from radixmesh.wire.sampling import SamplingParams

from .upstream_fakes import FakeCall, FakeReplica, RpcFailure, Watcher, response


# ---- the tokenizer upstream ---------------------------------------------------------------------------
class AsyncTokenizer:
    """The tokenizer service's asynchronous stub (Tokenize is awaited: the event loop keeps serving)."""

    def __init__(self, fail: grpc.RpcError | None = None) -> None:
        self.fail = fail

    async def Tokenize(self, request: Any, timeout: float) -> tokenizer_pb2.TokenizeResponse:
        if self.fail is not None:
            raise self.fail
        ids = [ord(c) for c in request.text] if request.text else [1, 2, 3]
        return tokenizer_pb2.TokenizeResponse(token_ids=ids, block_hashes=common_pb2.BlockHashes(hashes=[99, 98]),
                                              prompt_text="<chat>")


class SyncTokenizer:
    """The tokenizer service's blocking stub (Decode, without a local copy of the tokenizer)."""

    def Decode(self, request: Any, timeout: float) -> tokenizer_pb2.DecodeResponse:
        return tokenizer_pb2.DecodeResponse(text="".join(chr(i) for i in request.token_ids),
                                            token_texts=[chr(i) for i in request.token_ids])


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A current event loop: gRPC's asyncio channels are created on one (nothing is dialled here)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        yield loop
    finally:
        asyncio.set_event_loop(None)
        loop.close()


@pytest.fixture
def tokenizer(loop: asyncio.AbstractEventLoop) -> Iterator[TokenizerUpstream]:
    upstream = TokenizerUpstream("127.0.0.1:1")  # nothing is dialled: the stubs are stand-ins
    upstream._sync = SyncTokenizer()  # type: ignore[assignment]
    upstream.group.upstreams[0].stub = AsyncTokenizer()
    try:
        yield upstream
    finally:
        upstream.close()
        loop.run_until_complete(upstream.group.upstreams[0].close())


def test_the_services_block_hashes_travel_with_its_ids(tokenizer: TokenizerUpstream,
                                                       loop: asyncio.AbstractEventLoop) -> None:
    ids = loop.run_until_complete(tokenizer.encode("hi"))
    assert ids == [104, 105] and list(tokenizer.prompt_hashes(ids).hashes) == [99, 98]
    own = [5, 6, 7, 8] * 8  # ids a client sent itself: hashed here, with the same function
    assert list(tokenizer.prompt_hashes(own).hashes) == block_hashes(own, tokenizer.block_size)
    assert tokenizer.prompt_hashes(own).block_size == tokenizer.block_size


def test_the_hash_cache_keeps_the_latest_prompts(tokenizer: TokenizerUpstream, loop: asyncio.AbstractEventLoop,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_upstream, "HASH_CACHE_SIZE", 2)
    for text in ("a", "b", "c"):
        loop.run_until_complete(tokenizer.encode(text))
    assert list(tokenizer.prompt_hashes([ord("a")]).hashes) == block_hashes([ord("a")], tokenizer.block_size)
    assert list(tokenizer.prompt_hashes([ord("c")]).hashes) == [99, 98]


def test_chats_and_decoding_through_the_service(tokenizer: TokenizerUpstream,
                                                loop: asyncio.AbstractEventLoop) -> None:
    chat = loop.run_until_complete(tokenizer.chat([{"role": "user", "content": "x"}], True))
    assert list(chat.token_ids) == [1, 2, 3]
    with pytest.raises(RadixMeshError, match="every message needs a 'content'"):
        loop.run_until_complete(tokenizer.chat([{"role": "user"}], True))
    assert tokenizer.decode([104, 105]) == "hi" and tokenizer.token_texts([104, 105]) == ["h", "i"]


def test_an_unreachable_tokenizer_is_marked_down(tokenizer: TokenizerUpstream,
                                                  loop: asyncio.AbstractEventLoop) -> None:
    watcher = Watcher()
    tokenizer.watcher = watcher  # type: ignore[assignment]
    upstream = tokenizer.group.upstreams[0]
    upstream.stub = AsyncTokenizer(fail=RpcFailure(grpc.StatusCode.UNAVAILABLE, "refused"))
    with pytest.raises(RadixMeshError) as info:
        loop.run_until_complete(tokenizer.encode("x"))
    assert info.value.code is ErrorCode.UNAVAILABLE and watcher.down == ["127.0.0.1:1"]
    upstream.stub = AsyncTokenizer(fail=RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "bad", own=True))
    with pytest.raises(RadixMeshError):
        loop.run_until_complete(tokenizer.encode("x"))
    assert watcher.down == ["127.0.0.1:1"]  # its own error: still up


# ---- the model card -----------------------------------------------------------------------------------
INFO = worker_pb2.GetModelInfoResponse(model_name="m", model_path="/m", context_len=64, vocab_size=100,
                                       max_running_requests=4, engine_config_json='{"dtype": "bfloat16"}')
TOK = tokenizer_pb2.GetTokenizerInfoResponse(fingerprint="f", tokenizer_path="/t", block_size=8)


def card_reader(fail_first: bool = False) -> tuple[ModelCardReader, Readiness, Any]:
    answers: list[Any] = [RpcFailure(grpc.StatusCode.UNAVAILABLE, "loading")] if fail_first else []

    async def model_info(request: Any, timeout: float) -> Any:
        if answers:
            raise answers.pop()
        return INFO

    async def tokenizer_info(request: Any, timeout: float) -> Any:
        return TOK

    target = SimpleNamespace(address="r:1", stub=SimpleNamespace(GetModelInfo=model_info))
    generation_part = SimpleNamespace(group=SimpleNamespace(up=True, ready=lambda: [target],
                                                            description="the router at r:1"),
                                      target_kind="router", target_address="r:1")
    tokenizer_part = SimpleNamespace(address="t:1", stub=SimpleNamespace(GetTokenizerInfo=tokenizer_info),
                                     group=SimpleNamespace(up=True, description="the tokenizer at t:1"),
                                     block_size=16, local_tokenizer=None, pool=None, wants_copy=False)
    readiness = Readiness("gateway")
    reader = ModelCardReader(tokenizer_part, generation_part, readiness, None)  # type: ignore[arg-type]
    return reader, readiness, tokenizer_part


def test_the_card_is_read_once_both_sides_answer_and_callbacks_run() -> None:
    reader, readiness, tok = card_reader()
    seen: list[ModelCard] = []
    reader.when_known(seen.append)

    async def run() -> None:
        reader.on_upstream_change()
        while reader.card is None:
            await asyncio.sleep(0.01)
        await reader.close()

    asyncio.run(run())
    card = reader.card
    assert card is not None and seen == [card] and readiness.get("model").up
    assert (card.name, card.context_len, card.tokenizer_path, card.extra["dtype"]) == ("m", 64, "/t", "bfloat16")
    assert tok.block_size == 8  # the service's block size from now on
    late: list[ModelCard] = []
    reader.when_known(late.append)
    assert late == [card]


def test_a_failed_read_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(card_module, "RETRY_S", 0.01)
    reader, readiness, _ = card_reader(fail_first=True)
    details: list[str] = []

    async def run() -> None:
        reader.on_upstream_change()
        while reader.card is None:
            if "model" in readiness:
                details.append(readiness.get("model").detail)
            await asyncio.sleep(0.005)
        await reader.close()

    asyncio.run(run())
    assert reader.card is not None and any("loading" in d for d in details)


# ---- the backend --------------------------------------------------------------------------------------
async def with_backend(check: Any, **kwargs: Any) -> ClusterBackend:
    """Run `check(backend)` on a new backend (its channels on this loop), then close it."""
    backend = ClusterBackend("127.0.0.1:1", "127.0.0.1:2", **kwargs)
    try:
        check(backend)
    finally:
        await backend.close()
    return backend


def with_card(backend: ClusterBackend) -> None:
    backend.model.card = ModelCard(name="m", aliases=frozenset(), model_path="", tokenizer_path="", context_len=16,
                                   vocab_size=50, max_running_requests=4, created=0)
    backend.readiness.set("tokenizer", True)
    backend.readiness.set("router", True)
    backend.readiness.add("model", "the model", up=True)


def test_a_request_is_checked_before_anything_is_sent() -> None:
    def check(backend: ClusterBackend) -> None:
        with_card(backend)
        assert backend.is_healthy and backend.card.name == "m"
        backend.validate([1, 2], SamplingParams(max_new_tokens=2))
        for ids, params, field in (([], SamplingParams(), "prompt"), (list(range(16)), SamplingParams(), "prompt"),
                                   ([1, 60], SamplingParams(), "input_ids"),
                                   ([1], SamplingParams(top_p=2.0), "top_p"),
                                   ([1], SamplingParams(regex="("), "regex")):
            with pytest.raises(RadixMeshError) as info:
                backend.validate(ids, params)
            assert info.value.param == field, (ids, params)

    asyncio.run(with_backend(check))


def test_the_backend_is_unready_until_the_card_is_known_and_while_closing() -> None:
    def check(backend: ClusterBackend) -> None:
        assert not backend.is_healthy
        with pytest.raises(RadixMeshError) as info:
            _ = backend.card
        assert info.value.code is ErrorCode.UNAVAILABLE
        assert backend.targets is backend.generation.group and backend.target_kind == "router"
        assert backend.tokenizer_address == "127.0.0.1:1" and backend.target_address == "127.0.0.1:2"
        assert backend.readiness_details()["detokenize"] == "service"

    backend = asyncio.run(with_backend(check))
    assert backend.not_ready_reason() == "the gateway is shutting down"


def test_n_branches_get_their_own_seeds() -> None:
    def check(backend: ClusterBackend) -> None:
        assert backend.branch_params(SamplingParams()) == [SamplingParams()]
        seeds = [p.seed for p in backend.branch_params(SamplingParams(n=3, seed=10))]
        assert seeds == [10, 11, 12] and all(p.n == 1 for p in backend.branch_params(SamplingParams(n=2)))

    asyncio.run(with_backend(check))


def test_bad_detokenize_mode_is_named() -> None:
    with pytest.raises(RadixMeshError) as info:
        ClusterBackend("127.0.0.1:1", "127.0.0.1:2", detokenize="psychic")
    assert info.value.param == "detokenize"


def test_a_generate_streams_chunks_through_the_detokenizer_and_cancels_on_exit() -> None:
    call = FakeCall([response(104), response(105)])
    replica = FakeReplica("b:1", call)
    texts: list[str] = []

    class Detok:
        async def text(self, msg: Any) -> str:
            texts.append(chr(msg.token_ids[0]))
            return texts[-1]

        async def finish(self) -> None:
            texts.append("<end>")

        def close(self) -> None:
            texts.append("<closed>")

    async def run() -> list[str]:
        backend = ClusterBackend("127.0.0.1:1", "127.0.0.1:2")
        try:
            backend.generation.group = UpstreamGroup("router", [replica])  # type: ignore[list-item]
            backend.tokenizer.stream_text = lambda rid, params: Detok()  # type: ignore[method-assign, return-value]
            return [chunk.text async for chunk in backend.generate([1, 2], SamplingParams(), rid="g")]
        finally:
            await backend.close()

    assert asyncio.run(run()) == ["h", "i"]
    assert texts == ["h", "i", "<end>", "<closed>"] and call.cancelled and replica.log == ["generate g"]
