"""The tokenizer service as the cluster gateway uses it: tokenize, chat templates, detokenize.

Tokenize once: `encode`/`chat` get token ids and the prompt's block hashes, kept (`prompt_hashes`) until the
prompt's Generate carries them, so neither the router nor the worker tokenizes. With `--tokenize local` (the
default) text and chat prompts are encoded in this process, on a `TokenizerPool` over a copy of the service's
tokenizer (fingerprint-checked: the same ids, templates and hashes), which saves the Tokenize round trip (~1.4
ms for a 2,400-token prompt on a 2-core machine); until the copy is loaded, and for prompts with images, the
service tokenizes. Ids a client sent itself are hashed here with the same function. Detokenizing happens in this
process with the copy (`--detokenize local`), else through the service.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Awaitable
from typing import Any

import grpc

from radixmesh.common import tls, tracing
from radixmesh.common.errors import RadixMeshError
from radixmesh.common.grpc_errors import from_rpc_error
from radixmesh.engine import hf_tokenizer as hf_text
from radixmesh.engine.mm.prompt import MultimodalPrompt, PromptWithImages
from radixmesh.engine.tokenize_pool import DEFAULT_TOKENIZER_WORKERS, Encoded, TokenizerPool, traced
from radixmesh.gateway.detokenizers import LocalText, ServiceText, StreamText, fetch_tokenizer
from radixmesh.gateway.generate_upstream import unreachable
from radixmesh.gateway.images import tokenize_request, tokenized_prompt
from radixmesh.gateway.upstreams import CHANNEL_OPTIONS, Upstream, UpstreamGroup, UpstreamWatcher
from radixmesh.protocol import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from radixmesh.tokenizer_service.images import chat_messages, text_only
from radixmesh.wire.block_hash import DEFAULT_BLOCK_SIZE, block_hashes
from radixmesh.wire.chat_convert import chat_to_proto, tools_from_proto
from radixmesh.wire.lora import adapter_extra_key
from radixmesh.wire.sampling import SamplingParams

logger = logging.getLogger(__name__)
HASH_CACHE_SIZE = 1024
"""Prompts whose block hashes (from Tokenize) are kept until their Generate call."""
TOKENIZE_TIMEOUT_S = 10.0
"""Bound on a Tokenize call (awaited: the event loop streams other requests meanwhile) and on the blocking
Decode call of logprob texts without a local tokenizer copy."""
IMAGE_TOKENIZE_TIMEOUT_S = 60.0
"""Bound on a Tokenize call with images (the tokenizer service may fetch and resize them)."""


class TokenizerUpstream:
    """One tokenizer service: awaited tokenize calls (text, chat, images), detokenize calls (blocking where the
    gateway backend contract is synchronous) and the prompts' block hashes."""

    def __init__(self, address: str, tokenize_locally: bool = False, detokenize_locally: bool = True,
                 tokenizer_workers: int = DEFAULT_TOKENIZER_WORKERS) -> None:
        """`tokenize_locally` / `detokenize_locally`: use the copy of the service's tokenizer (once fetched) for
        text and chat prompts / for output streams; `tokenizer_workers`: threads of the local pool."""
        self.address = address
        self.tokenize_locally = tokenize_locally
        self.detokenize_locally = detokenize_locally
        self.tokenizer_workers = tokenizer_workers
        self.pool: TokenizerPool | None = None
        """Encodes text and chat prompts in this process (`tokenize_locally`, once the copy is loaded)."""
        self.group = UpstreamGroup("tokenizer", [Upstream("tokenizer", address,
                                                          tokenizer_pb2_grpc.TokenizerServiceStub)])
        self.watcher: UpstreamWatcher | None = None
        """Told when the service stops answering (set by the backend that watches it)."""
        self._sync_channel = tls.sync_channel(address, options=CHANNEL_OPTIONS)
        self._sync = tokenizer_pb2_grpc.TokenizerServiceStub(tracing.instrument_channel(self._sync_channel))
        self._hashes: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
        self.block_size = DEFAULT_BLOCK_SIZE
        """Tokens per block of the prompts' hashes (the service's, once its info was read)."""
        self.local_tokenizer: Any = None
        """The service's tokenizer, copied here ("local" detokenization), once loaded."""

    @property
    def wants_copy(self) -> bool:
        """Whether this gateway works with a copy of the service's tokenizer (local tokenization or
        detokenization)."""
        return self.tokenize_locally or self.detokenize_locally

    @property
    def stub(self) -> Any:
        """The service's asynchronous stub."""
        return self.group.upstreams[0].stub

    # ---- text -> tokens ---------------------------------------------------------------------------
    async def _tokenize(self, request: tokenizer_pb2.TokenizeRequest) -> tokenizer_pb2.TokenizeResponse:
        try:
            response = await self.stub.Tokenize(request, timeout=TOKENIZE_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self.error(exc) from None
        self._remember_hashes(list(response.token_ids), list(response.block_hashes.hashes))
        return response

    async def encode(self, text: str) -> list[int]:
        if self.pool is not None:
            return (await self._local("text", self.pool.encode(text, True, after=self._hash_blocks()))).ids
        response = await self._tokenize(tokenizer_pb2.TokenizeRequest(text=text, block_size=self.block_size))
        return list(response.token_ids)

    async def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                   tools: list[dict[str, Any]] | None = None) -> tokenizer_pb2.TokenizeResponse:
        conversation = chat_to_proto(messages, add_generation_prompt, tools)
        if self.pool is None:
            return await self._tokenize(tokenizer_pb2.TokenizeRequest(chat=conversation,
                                                                      block_size=self.block_size))
        # the messages as the service would read them from the request (the same rendering, tools included)
        encoded = await self._local("chat", self.pool.encode_chat(
            text_only(chat_messages(conversation)), add_generation_prompt, after=self._hash_blocks(),
            tools=tools_from_proto(conversation)))
        return tokenizer_pb2.TokenizeResponse(
            token_ids=encoded.ids, prompt_text=encoded.text,
            block_hashes=common_pb2.BlockHashes(block_size=self.block_size, hashes=encoded.extra))

    async def _local(self, kind: str, encoding: Awaitable[Encoded[list[int]]]) -> Encoded[list[int]]:
        """A prompt encoded on this process's pool, its hashes kept; in a `gateway.tokenize` span when tracing is
        on (the attributes of the service's Tokenize span)."""
        encoded = await traced("gateway.tokenize", kind, encoding, {"tokenize.block_size": self.block_size})
        self._remember_hashes(encoded.ids, encoded.extra)
        return encoded

    def _hash_blocks(self) -> functools.partial[list[int]]:
        """The service's block hashing of a prompt's ids (run on the pool's thread after encoding)."""
        return functools.partial(block_hashes, block_size=self.block_size, extra_key=b"")

    async def tokenize_multimodal(self, prompt: PromptWithImages) -> MultimodalPrompt:
        """The service reads, preprocesses and places the images (its limits apply)."""
        try:
            response = await self.stub.Tokenize(tokenize_request(prompt, self.block_size),
                                                timeout=IMAGE_TOKENIZE_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self.error(exc) from None
        self._remember_hashes(list(response.token_ids), list(response.block_hashes.hashes))
        return tokenized_prompt(response)

    def _remember_hashes(self, ids: list[int], hashes: list[int]) -> None:
        self._hashes[tuple(ids)] = hashes
        while len(self._hashes) > HASH_CACHE_SIZE:
            self._hashes.popitem(last=False)

    def prompt_hashes(self, ids: list[int], lora: str | None = None) -> common_pb2.BlockHashes:
        """The prompt's block chain: as the tokenizer service computed it, or (ids sent by the client) here; an
        adapter's prompts chain under its own extra key (`radixmesh.wire.lora`)."""
        hashes = self._hashes.get(tuple(ids)) if lora is None else None
        if hashes is None:
            hashes = block_hashes(ids, self.block_size, adapter_extra_key(lora))
        return common_pb2.BlockHashes(block_size=self.block_size, hashes=hashes)

    # ---- tokens -> text ---------------------------------------------------------------------------
    def _decode(self, token_ids: list[int], per_token: bool) -> tokenizer_pb2.DecodeResponse:
        try:
            return self._sync.Decode(tokenizer_pb2.DecodeRequest(token_ids=token_ids, per_token=per_token),
                                     timeout=TOKENIZE_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self.error(exc) from None

    def decode(self, token_ids: list[int]) -> str:
        if self.local_tokenizer is not None:
            return hf_text.decode_text(self.local_tokenizer, token_ids)
        return self._decode(token_ids, per_token=False).text

    def token_texts(self, token_ids: list[int]) -> list[str]:
        if self.local_tokenizer is not None:
            return hf_text.token_texts(self.local_tokenizer, token_ids)
        return list(self._decode(token_ids, per_token=True).token_texts)

    def stream_text(self, rid: str, params: SamplingParams) -> StreamText:
        """The detokenizer of one request's stream: here with the copied tokenizer, else through the service."""
        if self.local_tokenizer is not None:
            return LocalText(self.local_tokenizer, rid, params)
        return ServiceText(self.stub, rid, params, self.error)

    async def fetch_local_tokenizer(self) -> None:
        """Tokenize and/or detokenize in this process from now on (as configured), with a copy of the service's
        tokenizer; if it cannot be loaded, both go through the service."""
        try:
            tokenizer = await fetch_tokenizer(self.stub, self.address)
        except RadixMeshError as exc:
            logger.warning("gateway: tokenizing and detokenizing through the tokenizer service: its tokenizer could "
                           "not be copied here (%s)", exc.message)
            return
        if self.detokenize_locally:
            self.local_tokenizer = tokenizer
        if self.tokenize_locally:
            self.pool = TokenizerPool(tokenizer, self.tokenizer_workers)
        logger.warning("gateway: a copy of the tokenizer at %s (fingerprint checked) %s in this process", self.address,
                       " and ".join(kind for kind, on in (("tokenizes prompts", self.tokenize_locally),
                                                          ("detokenizes streams", self.detokenize_locally)) if on))

    # ---- failures ---------------------------------------------------------------------------------
    def error(self, exc: grpc.RpcError) -> RadixMeshError:
        """The domain error of a failed call; a service that stopped answering is marked down."""
        error = from_rpc_error(exc, f"tokenizer at {self.address}")
        if unreachable(exc) and self.watcher is not None:
            self.watcher.mark_down(self.group, self.group.upstreams[0], error.message)
        return error

    def close(self) -> None:
        self._sync_channel.close()
        if self.pool is not None:
            self.pool.close()
