"""`grpc` backend: the gateway in a cluster. Tokenizes through the tokenizer service, generates
through a router (or straight through one worker), detokenizes the stream through the tokenizer.

Tokenize once: `encode`/`apply_chat_template` get token ids and the prompt's block hashes from
the tokenizer service; the hashes travel with the ids in GenerateRequest, so neither the router
nor the worker tokenizes. Ids that a client sent itself are hashed here with the same function.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from typing import Any

import grpc
import grpc.aio
import msgspec

from radixmesh.common import tracing
from radixmesh.common.convert import load_from_proto, proto_to_chunk, sampling_to_proto
from radixmesh.common.errors import invalid_argument
from radixmesh.common.grpc_errors import from_rpc_error
from radixmesh.gateway.backend import Backend, GenerationChunk, ModelCard, SamplingParams
from radixmesh.index.block_hash import DEFAULT_BLOCK_SIZE, block_hashes
from radixmesh.protocol import (
    common_pb2,
    router_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

HASH_CACHE_SIZE = 1024
"""Prompts whose block hashes (from Tokenize) are kept until their Generate call."""
TOKENIZE_TIMEOUT_S = 10.0
"""Bound on the blocking tokenizer calls (they hold the event loop, as local tokenization does)."""
CONTROL_TIMEOUT_S = 30.0
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


class GrpcBackend(Backend):
    """Talks to a tokenizer service and to a router (target_kind "router") or one worker ("worker")."""

    def __init__(self, tokenizer_address: str, target_address: str, target_kind: str = "router") -> None:
        assert target_kind in ("router", "worker"), f"target_kind {target_kind!r} is not router or worker"
        self.tokenizer_address, self.target_address, self.target_kind = tokenizer_address, target_address, target_kind
        self._tok_sync_channel = grpc.insecure_channel(tokenizer_address, options=CHANNEL_OPTIONS)
        self._tok_sync = tokenizer_pb2_grpc.TokenizerServiceStub(tracing.instrument_channel(self._tok_sync_channel))
        self._tok_channel = grpc.aio.insecure_channel(tokenizer_address, options=CHANNEL_OPTIONS,
                                                      interceptors=tracing.client_interceptors())
        self._tok = tokenizer_pb2_grpc.TokenizerServiceStub(self._tok_channel)
        self._target_channel = grpc.aio.insecure_channel(target_address, options=CHANNEL_OPTIONS,
                                                         interceptors=tracing.client_interceptors())
        stub_class = router_pb2_grpc.RouterServiceStub if target_kind == "router" else worker_pb2_grpc.WorkerServiceStub
        self._target: Any = stub_class(self._target_channel)
        self._hashes: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
        self._card: ModelCard | None = None
        self.block_size = DEFAULT_BLOCK_SIZE
        self._closed = False

    @classmethod
    async def start(cls, tokenizer_address: str, target_address: str, target_kind: str = "router",
                    served_model_name: str | None = None) -> GrpcBackend:
        """Connect and read the model's facts from the target and the tokenizer service."""
        backend = cls(tokenizer_address, target_address, target_kind)
        try:
            info = await backend._call(backend._target.GetModelInfo, worker_pb2.GetModelInfoRequest(),
                                       backend.target_address, wait_for_ready=True)
            tok = await backend._call(backend._tok.GetTokenizerInfo, tokenizer_pb2.GetTokenizerInfoRequest(),
                                      backend.tokenizer_address, wait_for_ready=True)
        except BaseException:
            await backend.close()
            raise
        backend.block_size = tok.block_size or DEFAULT_BLOCK_SIZE
        backend._card = _make_card(info, tok, served_model_name, backend)
        return backend

    async def _call(self, method: Callable[..., Any], request: Any, peer: str, **kwargs: Any) -> Any:
        try:
            return await method(request, timeout=CONTROL_TIMEOUT_S, **kwargs)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, peer) from None

    @property
    def card(self) -> ModelCard:
        assert self._card is not None, "GrpcBackend.start() was not awaited"
        return self._card

    @property
    def is_healthy(self) -> bool:
        if self._closed:
            return False
        bad = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)
        return all(ch.get_state(try_to_connect=True) not in bad for ch in (self._target_channel, self._tok_channel))

    # ---- text <-> tokens (blocking calls: the Backend contract is synchronous) ------------------
    def _tokenize(self, request: tokenizer_pb2.TokenizeRequest) -> tokenizer_pb2.TokenizeResponse:
        try:
            response = self._tok_sync.Tokenize(request, timeout=TOKENIZE_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.tokenizer_address) from None
        self._remember_hashes(list(response.token_ids), list(response.block_hashes.hashes))
        return response

    def encode(self, text: str) -> list[int]:
        return list(self._tokenize(tokenizer_pb2.TokenizeRequest(text=text, block_size=self.block_size)).token_ids)

    def _chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> tokenizer_pb2.TokenizeResponse:
        try:
            chat = [tokenizer_pb2.ChatMessage(role=str(m["role"]), content=str(m["content"])) for m in messages]
        except KeyError as exc:
            raise invalid_argument(f"every message needs a {exc.args[0]!r}", "messages") from None
        conversation = tokenizer_pb2.ChatConversation(messages=chat, add_generation_prompt=add_generation_prompt)
        return self._tokenize(tokenizer_pb2.TokenizeRequest(chat=conversation, block_size=self.block_size))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self._chat(messages, True).token_ids)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return str(self._chat(messages, add_generation_prompt).prompt_text)

    def _decode(self, token_ids: list[int], per_token: bool) -> tokenizer_pb2.DecodeResponse:
        try:
            return self._tok_sync.Decode(tokenizer_pb2.DecodeRequest(token_ids=token_ids, per_token=per_token),
                                         timeout=TOKENIZE_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.tokenizer_address) from None

    def decode(self, token_ids: list[int]) -> str:
        return self._decode(token_ids, per_token=False).text

    def token_texts(self, token_ids: list[int]) -> list[str]:
        return list(self._decode(token_ids, per_token=True).token_texts)

    def _remember_hashes(self, ids: list[int], hashes: list[int]) -> None:
        self._hashes[tuple(ids)] = hashes
        while len(self._hashes) > HASH_CACHE_SIZE:
            self._hashes.popitem(last=False)

    def prompt_hashes(self, ids: list[int]) -> common_pb2.BlockHashes:
        """The prompt's block chain: as the tokenizer service computed it, or (ids sent by the client) here."""
        hashes = self._hashes.get(tuple(ids))
        if hashes is None:
            hashes = block_hashes(ids, self.block_size)
        return common_pb2.BlockHashes(block_size=self.block_size, hashes=hashes)

    # ---- generation -----------------------------------------------------------------------------
    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        """The checks that need no engine; the worker checks everything again and its errors come back exact."""
        card = self.card
        params.validate(card.vocab_size)
        if not input_ids:
            raise invalid_argument("the prompt is empty", "prompt")
        if len(input_ids) >= card.context_len:
            raise invalid_argument(f"the prompt has {len(input_ids)} tokens, but the context length is "
                                   f"{card.context_len}", "prompt")
        if min(input_ids) < 0 or max(input_ids) >= card.vocab_size:
            raise invalid_argument(f"input_ids must be in [0, {card.vocab_size})", "input_ids")

    def _request(self, input_ids: list[int], params: SamplingParams, rid: str,
                 prefill_only: bool = False) -> worker_pb2.GenerateRequest:
        return worker_pb2.GenerateRequest(request_id=rid, token_ids=input_ids,
                                          block_hashes=self.prompt_hashes(input_ids),
                                          sampling_params=sampling_to_proto(params), prefill_only=prefill_only)

    async def generate(self, input_ids: list[int], params: SamplingParams,
                       rid: str | None = None) -> AsyncGenerator[GenerationChunk, None]:
        rid = rid or uuid.uuid4().hex
        call = self._target.Generate(self._request(list(input_ids), params, rid))
        detok = self._tok.Detokenize()
        try:
            await detok.write(tokenizer_pb2.DetokenizeRequest(start=tokenizer_pb2.DetokenizeStart(
                request_id=rid, skip_special_tokens=params.skip_special_tokens, stop=list(params.stop))))
            async for msg in call:
                text = await self._detokenize(detok, msg)
                yield proto_to_chunk(msg, text)
            await _end_stream(detok)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.target_address) from None
        finally:
            call.cancel()  # no-op once finished; otherwise the worker aborts and frees the KV
            detok.cancel()

    async def _detokenize(self, detok: Any, msg: worker_pb2.GenerateResponse) -> str:
        stop_token = msg.finish_reason == common_pb2.FINISH_REASON_STOP and msg.HasField("matched_stop_token_id")
        tokens = tokenizer_pb2.DetokenizeTokens(token_ids=msg.token_ids, finish_reason=msg.finish_reason,
                                                ends_with_stop_token=stop_token and len(msg.token_ids) > 0)
        try:
            await detok.write(tokenizer_pb2.DetokenizeRequest(tokens=tokens))
            response = await detok.read()
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.tokenizer_address) from None
        if response is grpc.aio.EOF:
            raise from_rpc_error(await _status_error(detok), self.tokenizer_address)
        return str(response.text)

    async def cache_prefix(self, input_ids: list[int]) -> None:
        call = self._target.Generate(self._request(list(input_ids), SamplingParams(), uuid.uuid4().hex, True))
        try:
            async for _ in call:
                pass
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.target_address) from None

    def branch_params(self, params: SamplingParams) -> list[SamplingParams]:
        if params.n == 1:
            return [params]
        return [msgspec.structs.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
                for i in range(params.n)]

    async def abort(self, rid: str) -> None:
        with contextlib.suppress(Exception):  # an abort of an unknown or finished request is not an error
            await self._target.Abort(worker_pb2.AbortRequest(request_id=rid), timeout=CONTROL_TIMEOUT_S)

    # ---- control ---------------------------------------------------------------------------------
    async def flush_cache(self) -> bool:
        response = await self._call(self._target.FlushCache, worker_pb2.FlushCacheRequest(), self.target_address)
        return bool(response.flushed)

    async def server_info(self) -> dict[str, Any]:
        response = await self._call(self._target.GetLoad, worker_pb2.GetLoadRequest(), self.target_address)
        return load_from_proto(response.load)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._target_channel.close()
        await self._tok_channel.close()
        self._tok_sync_channel.close()


class _StreamFailed(grpc.RpcError):
    """A stream that ended without a reply, carrying its final status."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: Any) -> None:
        super().__init__(details)
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailing


async def _end_stream(call: Any) -> None:
    """Half-close a bidirectional call and read its end, so it finishes OK (its trace span too) instead of
    being cancelled. The text is complete by then: a tokenizer failing to say goodbye is not the client's error."""
    with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError):
        await call.done_writing()
        await asyncio.wait_for(call.read(), TOKENIZE_TIMEOUT_S)


async def _status_error(call: Any) -> grpc.RpcError:
    return _StreamFailed(await call.code(), await call.details(), await call.trailing_metadata())


def _make_card(info: worker_pb2.GetModelInfoResponse, tok: tokenizer_pb2.GetTokenizerInfoResponse,
               served_model_name: str | None, backend: GrpcBackend) -> ModelCard:
    """The served model as `radixmesh serve` describes it: the workers' engine flags, the worker's
    model path and the tokenizer service's tokenizer path (what clients load to count tokens)."""
    name = served_model_name or info.model_name
    aliases = {info.model_name, *info.aliases} - {name}
    extra: dict[str, Any] = {}
    with contextlib.suppress(ValueError):
        extra.update(json.loads(info.engine_config_json or "{}"))
    extra.update({"backend": "grpc", backend.target_kind: backend.target_address,
                  "tokenizer_address": backend.tokenizer_address, "tokenizer_fingerprint": tok.fingerprint})
    return ModelCard(name=name, aliases=frozenset(aliases), model_path=info.model_path,
                     tokenizer_path=tok.tokenizer_path, context_len=info.context_len, vocab_size=info.vocab_size,
                     max_running_requests=info.max_running_requests, created=int(time.time()), extra=extra)
