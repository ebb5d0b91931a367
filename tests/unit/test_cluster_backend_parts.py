"""The cluster gateway's backend by its parts (gateway/generate_upstream.py, tokenizer_upstream.py, model_card.py,
cluster_backend.py), over stand-in replicas: failover before a stream starts, errors after, aborts and control
calls, the prompts' block hashes, the model card, and the checks made before anything is sent."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.common.grpc_errors import ERROR_METADATA_KEY, error_detail_bytes, to_grpc_status
from radixmesh.common.readiness import Readiness
from radixmesh.gateway import model_card as card_module
from radixmesh.gateway import tokenizer_upstream
from radixmesh.gateway.backend import ModelCard
from radixmesh.gateway.cluster_backend import ClusterBackend
from radixmesh.gateway.generate_upstream import GenerateUpstream, carries_error, unreachable
from radixmesh.gateway.model_card import ModelCardReader
from radixmesh.gateway.tokenizer_upstream import TokenizerUpstream
from radixmesh.gateway.upstreams import UpstreamGroup
from radixmesh.protocol import common_pb2, tokenizer_pb2, worker_pb2
from radixmesh.wire.block_hash import block_hashes
from radixmesh.wire.sampling import SamplingParams


class RpcFailure(grpc.RpcError):
    """A failed call as grpc raises it: a status code, details, and (from a radixmesh service) an error trailer."""

    def __init__(self, code: grpc.StatusCode, details: str = "", own: bool = False) -> None:
        self._code, self._details = code, details
        own_code = next((c for c in ErrorCode if to_grpc_status(RadixMeshError(c, details))[0] == code),
                        ErrorCode.INTERNAL)
        self._trailer = ((ERROR_METADATA_KEY, error_detail_bytes(RadixMeshError(own_code, details))),) if own else ()

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return self._trailer


class FakeCall:
    """A Generate stream: its messages, then EOF, or a failure after `fail_after` messages."""

    def __init__(self, messages: list[Any], fail_after: int | None = None, error: Exception | None = None) -> None:
        self.messages, self.fail_after, self.error = list(messages), fail_after, error
        self.read_count = 0
        self.cancelled = False

    async def read(self) -> Any:
        if self.fail_after is not None and self.read_count >= self.fail_after:
            assert self.error is not None
            raise self.error
        self.read_count += 1
        return self.messages.pop(0) if self.messages else grpc.aio.EOF

    def cancel(self) -> None:
        self.cancelled = True


class FakeReplica:
    """A router replica: what its stub answers, and what it was asked."""

    def __init__(self, address: str, call: FakeCall | None = None, up: bool = True) -> None:
        self.kind, self.address, self.up, self.detail, self.lane = "router", address, up, "", None
        self.call = call or FakeCall([])
        self.log: list[str] = []
        self.wake = asyncio.Event()
        replica = self

        class Stub:
            def Generate(self, request: Any) -> FakeCall:
                replica.log.append(f"generate {request.request_id}")
                return replica.call

            async def Abort(self, request: Any, timeout: float) -> Any:
                replica.log.append(f"abort {request.request_id}")
                return worker_pb2.AbortResponse()

            async def GetLoad(self, request: Any, timeout: float) -> Any:
                return worker_pb2.GetLoadResponse(load=common_pb2.WorkerLoad(num_running_reqs=2, kv_usage=0.5))

            async def FlushCache(self, request: Any, timeout: float) -> Any:
                return worker_pb2.FlushCacheResponse(flushed=True)

        self.stub = Stub()

    @property
    def description(self) -> str:
        return f"the router at {self.address}"


class Watcher:
    def __init__(self) -> None:
        self.down: list[str] = []

    def mark_down(self, group: Any, upstream: Any, detail: str) -> None:
        self.down.append(upstream.address)
        upstream.up = False


def generation(*replicas: FakeReplica, reason: str = "no router answers") -> tuple[GenerateUpstream, Watcher]:
    gen = GenerateUpstream("127.0.0.1:1", "router", lambda: reason, target=replicas[0])  # type: ignore[arg-type]
    gen.group = UpstreamGroup("router", list(replicas))  # type: ignore[arg-type]
    watcher = Watcher()
    gen.watcher = watcher  # type: ignore[assignment]
    return gen, watcher


def request(rid: str = "r") -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=rid, token_ids=[1, 2])


async def drain(gen: GenerateUpstream, rid: str = "r") -> list[Any]:
    return [msg async for msg in gen.stream(request(rid))]


def response(*ids: int) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(token_ids=list(ids))


# ---- the Generate upstream ----------------------------------------------------------------------------
def test_a_stream_comes_from_the_first_ready_replica_and_is_tracked_for_aborts() -> None:
    call = FakeCall([response(1), response(2)])
    first, second = FakeReplica("a:1", call), FakeReplica("b:1", up=False)
    gen, _ = generation(first, second)

    async def run() -> list[Any]:
        out = []
        async for msg in gen.stream(request("r")):
            assert gen.inflight["r"] is first  # while it streams, an abort goes here
            out.append(msg)
        return out

    assert [list(m.token_ids) for m in asyncio.run(run())] == [[1], [2]]
    assert "r" not in gen.inflight and call.cancelled and first.log == ["generate r"] and second.log == []


def test_an_unreachable_replica_before_the_first_message_is_skipped_and_marked_down() -> None:
    dead = FakeReplica("a:1", FakeCall([], fail_after=0, error=RpcFailure(grpc.StatusCode.UNAVAILABLE, "gone")))
    alive = FakeReplica("b:1", FakeCall([response(7)]))
    gen, watcher = generation(dead, alive)
    assert [list(m.token_ids) for m in asyncio.run(drain(gen))] == [[7]]
    assert watcher.down == ["a:1"] and dead.call.cancelled


def test_a_replicas_own_error_before_the_first_message_is_the_requests() -> None:
    bad = FakeReplica("a:1", FakeCall([], fail_after=0, error=RpcFailure(grpc.StatusCode.INVALID_ARGUMENT,
                                                                        "top_p out of range", own=True)))
    other = FakeReplica("b:1", FakeCall([response(7)]))
    gen, watcher = generation(bad, other)
    with pytest.raises(RadixMeshError) as info:
        asyncio.run(drain(gen))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and other.log == [] and watcher.down == []


def test_with_every_replica_gone_the_error_names_what_is_missing() -> None:
    dead = FakeReplica("a:1", FakeCall([], fail_after=0, error=RpcFailure(grpc.StatusCode.UNAVAILABLE, "gone")))
    gen, _ = generation(dead, reason="no router answers")
    with pytest.raises(RadixMeshError) as info:
        asyncio.run(drain(gen))
    assert info.value.code is ErrorCode.UNAVAILABLE and info.value.message == "no router answers"


def test_a_stream_that_breaks_after_it_started_is_unavailable_and_not_retried() -> None:
    broken = FakeReplica("a:1", FakeCall([response(1)], fail_after=1,
                                         error=RpcFailure(grpc.StatusCode.UNAVAILABLE, "reset")))
    spare = FakeReplica("b:1", FakeCall([response(9)]))
    gen, watcher = generation(broken, spare)
    got: list[Any] = []

    async def run() -> None:
        async for msg in gen.stream(request()):
            got.append(msg)

    with pytest.raises(RadixMeshError) as info:
        asyncio.run(run())
    assert info.value.code is ErrorCode.UNAVAILABLE and "broke after it started" in info.value.message
    assert len(got) == 1 and spare.log == [] and watcher.down == ["a:1"]


def test_a_targets_own_error_mid_stream_comes_through_as_it_is() -> None:
    failing = FakeReplica("a:1", FakeCall([response(1)], fail_after=1,
                                          error=RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, "KV full", own=True)))
    gen, watcher = generation(failing)
    with pytest.raises(RadixMeshError) as info:
        asyncio.run(drain(gen))
    assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED and watcher.down == []


def test_aborts_go_to_the_replica_running_the_request_or_to_every_ready_one() -> None:
    a, b, down = FakeReplica("a:1"), FakeReplica("b:1"), FakeReplica("c:1", up=False)
    gen, _ = generation(a, b, down)
    gen.inflight["known"] = b  # type: ignore[assignment]
    asyncio.run(gen.abort("known"))
    asyncio.run(gen.abort("unknown"))
    assert a.log == ["abort unknown"] and b.log == ["abort known", "abort unknown"] and down.log == []


def test_control_calls_go_to_a_ready_replica() -> None:
    gen, _ = generation(FakeReplica("a:1", up=False), FakeReplica("b:1"))
    load = asyncio.run(gen.load())
    assert (load.num_running_reqs, load.kv_usage) == (2, 0.5)
    assert asyncio.run(gen.flush_cache()) is True
    nobody, _ = generation(FakeReplica("a:1", up=False), reason="starting")
    with pytest.raises(RadixMeshError, match="starting"):
        nobody.control_target()


def test_one_worker_only() -> None:
    with pytest.raises(RadixMeshError) as info:
        GenerateUpstream("127.0.0.1:1,127.0.0.1:2", "worker", lambda: "")
    assert info.value.param == "worker"


def test_transport_failures_and_service_errors_are_told_apart() -> None:
    assert unreachable(RpcFailure(grpc.StatusCode.UNAVAILABLE))
    assert unreachable(RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED))
    assert not unreachable(RpcFailure(grpc.StatusCode.UNAVAILABLE, own=True))  # the service said so itself
    assert not unreachable(RpcFailure(grpc.StatusCode.INTERNAL))
    assert carries_error(RpcFailure(grpc.StatusCode.INTERNAL, own=True))


# ---- the tokenizer upstream ---------------------------------------------------------------------------
class SyncTokenizer:
    """The tokenizer service's blocking stub."""

    def __init__(self, fail: grpc.RpcError | None = None) -> None:
        self.fail = fail

    def Tokenize(self, request: Any, timeout: float) -> tokenizer_pb2.TokenizeResponse:
        if self.fail is not None:
            raise self.fail
        ids = [ord(c) for c in request.text] if request.text else [1, 2, 3]
        return tokenizer_pb2.TokenizeResponse(token_ids=ids, block_hashes=common_pb2.BlockHashes(hashes=[99, 98]),
                                              prompt_text="<chat>")

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
    try:
        yield upstream
    finally:
        upstream.close()
        loop.run_until_complete(upstream.group.upstreams[0].close())


def test_the_services_block_hashes_travel_with_its_ids(tokenizer: TokenizerUpstream) -> None:
    ids = tokenizer.encode("hi")
    assert ids == [104, 105] and list(tokenizer.prompt_hashes(ids).hashes) == [99, 98]
    own = [5, 6, 7, 8] * 8  # ids a client sent itself: hashed here, with the same function
    assert list(tokenizer.prompt_hashes(own).hashes) == block_hashes(own, tokenizer.block_size)
    assert tokenizer.prompt_hashes(own).block_size == tokenizer.block_size


def test_the_hash_cache_keeps_the_latest_prompts(tokenizer: TokenizerUpstream,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_upstream, "HASH_CACHE_SIZE", 2)
    for text in ("a", "b", "c"):
        tokenizer.encode(text)
    assert list(tokenizer.prompt_hashes([ord("a")]).hashes) == block_hashes([ord("a")], tokenizer.block_size)
    assert list(tokenizer.prompt_hashes([ord("c")]).hashes) == [99, 98]


def test_chats_and_decoding_through_the_service(tokenizer: TokenizerUpstream) -> None:
    assert list(tokenizer.chat([{"role": "user", "content": "x"}], True).token_ids) == [1, 2, 3]
    with pytest.raises(RadixMeshError, match="every message needs a 'content'"):
        tokenizer.chat([{"role": "user"}], True)
    assert tokenizer.decode([104, 105]) == "hi" and tokenizer.token_texts([104, 105]) == ["h", "i"]


def test_an_unreachable_tokenizer_is_marked_down(tokenizer: TokenizerUpstream) -> None:
    watcher = Watcher()
    tokenizer.watcher = watcher  # type: ignore[assignment]
    tokenizer._sync = SyncTokenizer(fail=RpcFailure(grpc.StatusCode.UNAVAILABLE, "refused"))  # type: ignore[assignment]
    with pytest.raises(RadixMeshError) as info:
        tokenizer.encode("x")
    assert info.value.code is ErrorCode.UNAVAILABLE and watcher.down == ["127.0.0.1:1"]
    tokenizer._sync = SyncTokenizer(fail=RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "bad", own=True))  # type: ignore[assignment]
    with pytest.raises(RadixMeshError):
        tokenizer.encode("x")
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
                                     block_size=16, local_tokenizer=None)
    readiness = Readiness("gateway")
    reader = ModelCardReader(tokenizer_part, generation_part, readiness, None, "service")  # type: ignore[arg-type]
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
