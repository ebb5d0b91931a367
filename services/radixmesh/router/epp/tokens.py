"""A prompt's token ids and block hashes, as the tokenizer service makes them.

Text and chat prompts are tokenized with the tokenizer service's tokenizer: by default a copy of it in this
process (fetched once with GetTokenizerFiles and checked against the service's fingerprint, as the gateway's
local detokenizer is), so that a pick pays no round trip; with `--epp-tokenize service`, or until the copy is
loaded, by a Tokenize call. Either way one tokenizer, one chat template and one hash function make the blocks
the picker looks up and the blocks the workers publish for the requests their HTTP API tokenizes. Token ids in
a body are hashed here. A tokenizer that is down or slow costs the request its cache lookup, never the request:
it is picked by load alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from radixmesh.common import aio, tls
from radixmesh.common.errors import RadixMeshError
from radixmesh.common.grpc_server import RECONNECT_OPTIONS
from radixmesh.engine.hf_tokenizer import encode_chat, encode_text
from radixmesh.protocol import tokenizer_pb2, tokenizer_pb2_grpc
from radixmesh.router.epp.prompt import PromptInput
from radixmesh.wire.block_hash import block_hashes
from radixmesh.wire.lora import adapter_extra_key

logger = logging.getLogger(__name__)
FETCH_RETRY_S = 5.0
"""Seconds between tries to copy the tokenizer while the service does not answer."""
LONG_TEXT_CHARS = 20_000
"""Longer prompts are tokenized in a thread (the event loop keeps answering other picks)."""
TOKENIZE_MODES = ("local", "service")


@dataclass(frozen=True)
class PromptTokens:
    """What the policy looks at: the prompt's length and block chain."""

    num_tokens: int
    block_hashes: tuple[int, ...]
    source: str
    """token-ids (hashed here) | tokenized (the copy here) | tokenized-service (a Tokenize call) | none (no
    prompt, or no tokenizer) | tokenizer-error."""
    token_ids: list[int] = dataclasses.field(default_factory=list, compare=False)
    """The ids (for an adapter's hashes, which take its extra key)."""


NO_TOKENS = PromptTokens(0, (), "none")


class PromptTokenizer:
    """The tokenizer service's tokenizer, copied here (`local`) or called (`service`); no address: ids only."""

    def __init__(self, address: str | None, block_size: int, timeout_s: float, mode: str = "local") -> None:
        assert mode in TOKENIZE_MODES, f"tokenize mode {mode!r} is not one of {TOKENIZE_MODES}"
        self.address = address
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.mode = mode
        self.channel = tls.aio_channel(address, options=RECONNECT_OPTIONS) if address else None
        self.stub = tokenizer_pb2_grpc.TokenizerServiceStub(self.channel) if self.channel is not None else None
        self.local: Any = None
        """The copy of the service's tokenizer, once loaded."""
        self._fetch_task: asyncio.Task[None] | None = None
        self._last_warning = 0.0

    def start(self) -> None:
        """Copy the service's tokenizer in the background (local mode); picks call the service meanwhile."""
        if self.mode == "local" and self.stub is not None:
            self._fetch_task = asyncio.get_running_loop().create_task(self._fetch(), name="epp-tokenizer-copy")

    async def _fetch(self) -> None:
        from radixmesh.gateway.detokenizers import fetch_tokenizer

        while True:
            try:
                self.local = await fetch_tokenizer(self.stub, f"tokenizer at {self.address}")
            except RadixMeshError as exc:
                logger.info("epp: could not copy the tokenizer yet (%s); calling Tokenize meanwhile", exc.message)
                await asyncio.sleep(FETCH_RETRY_S)
                continue
            logger.warning("epp: tokenizing with a copy of the tokenizer at %s", self.address)
            return

    async def tokens(self, prompt: PromptInput, adapter: str = "") -> PromptTokens:
        """The prompt's tokens; a LoRA adapter's block hashes take its extra key (radixmesh.wire.lora)."""
        found = await self._tokens(prompt)
        if not adapter or not found.num_tokens:
            return found
        return dataclasses.replace(found, block_hashes=tuple(self._hashes(found.token_ids, adapter)))

    def _hashes(self, ids: list[int], adapter: str = "") -> list[int]:
        return block_hashes(ids, self.block_size, adapter_extra_key(adapter or None))

    async def _tokens(self, prompt: PromptInput) -> PromptTokens:
        if prompt.kind == "ids":
            ids = list(prompt.token_ids)
            return PromptTokens(len(ids), tuple(self._hashes(ids)), "token-ids", ids)
        if prompt.kind == "none":
            return NO_TOKENS
        if self.local is not None:
            try:
                ids = await self._encode_here(prompt)
            except RadixMeshError as exc:  # a conversation the chat template rejects: the worker will say so
                logger.debug("epp: no tokens for a prompt: %s", exc.message)
                return PromptTokens(0, (), "tokenizer-error")
            return PromptTokens(len(ids), tuple(self._hashes(ids)), "tokenized", ids)
        if self.stub is None:
            return NO_TOKENS
        try:
            reply = await self.stub.Tokenize(self._request(prompt), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            self._warn(exc)
            return PromptTokens(0, (), "tokenizer-error")
        return PromptTokens(len(reply.token_ids), tuple(reply.block_hashes.hashes), "tokenized-service",
                            list(reply.token_ids))

    async def _encode_here(self, prompt: PromptInput) -> list[int]:
        """What the service's Tokenize returns for `prompt`: text with the model's special tokens at its start,
        chat through the chat template."""
        if prompt.kind == "text":
            if len(prompt.text) > LONG_TEXT_CHARS:
                return await asyncio.to_thread(encode_text, self.local, prompt.text)
            return encode_text(self.local, prompt.text)
        messages = [{"role": role, "content": content} for role, content in prompt.messages]
        if sum(len(content) for _, content in prompt.messages) > LONG_TEXT_CHARS:
            return await asyncio.to_thread(encode_chat, self.local, messages)
        return encode_chat(self.local, messages)

    def _request(self, prompt: PromptInput) -> tokenizer_pb2.TokenizeRequest:
        if prompt.kind == "text":
            return tokenizer_pb2.TokenizeRequest(text=prompt.text, block_size=self.block_size)
        chat = tokenizer_pb2.ChatConversation(
            messages=[tokenizer_pb2.ChatMessage(role=role, content=content) for role, content in prompt.messages])
        return tokenizer_pb2.TokenizeRequest(chat=chat, block_size=self.block_size)

    def _warn(self, exc: grpc.RpcError) -> None:
        now = time.monotonic()
        if now - self._last_warning > 10.0:  # at most one line per 10 s while the tokenizer fails
            self._last_warning = now
            code = exc.code().name if hasattr(exc, "code") else type(exc).__name__
            details = exc.details() if hasattr(exc, "details") else str(exc)
            logger.warning("epp: Tokenize at %s failed (%s: %s); picking by load alone meanwhile", self.address,
                           code, details)

    async def close(self) -> None:
        await aio.cancel_and_wait(self._fetch_task)
        if self.channel is not None:
            await self.channel.close()
