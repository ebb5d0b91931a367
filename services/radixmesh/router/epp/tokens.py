"""A prompt's token ids and block hashes: from the tokenizer service (text and chat), or hashed here (ids).

The same Tokenize call the gateway makes, so the blocks the picker looks up are those the workers publish
for the requests their HTTP API tokenizes (one tokenizer, one chat template, one hash). A tokenizer that is
down or slow costs the request its cache lookup, never the request: it is picked by load alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc
import grpc.aio

from radixmesh.common import tls
from radixmesh.common.grpc_server import RECONNECT_OPTIONS
from radixmesh.index.block_hash import block_hashes
from radixmesh.protocol import tokenizer_pb2, tokenizer_pb2_grpc
from radixmesh.router.epp.prompt import PromptInput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptTokens:
    """What the policy looks at: the prompt's length and block chain."""

    num_tokens: int
    block_hashes: tuple[int, ...]
    source: str
    """token-ids (hashed here) | tokenized (the tokenizer service) | none (no prompt, or no tokenizer)."""


NO_TOKENS = PromptTokens(0, (), "none")


class PromptTokenizer:
    """Tokenize calls to one tokenizer service (None: only token ids are hashed)."""

    def __init__(self, address: str | None, block_size: int, timeout_s: float) -> None:
        self.address = address
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.channel = tls.aio_channel(address, options=RECONNECT_OPTIONS) if address else None
        self.stub = tokenizer_pb2_grpc.TokenizerServiceStub(self.channel) if self.channel is not None else None
        self._last_warning = 0.0

    async def tokens(self, prompt: PromptInput) -> PromptTokens:
        if prompt.kind == "ids":
            ids = list(prompt.token_ids)
            return PromptTokens(len(ids), tuple(block_hashes(ids, self.block_size)), "token-ids")
        if prompt.kind == "none" or self.stub is None:
            return NO_TOKENS
        try:
            reply = await self.stub.Tokenize(self._request(prompt), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            self._warn(exc)
            return PromptTokens(0, (), "tokenizer-error")
        return PromptTokens(len(reply.token_ids), tuple(reply.block_hashes.hashes), "tokenized")

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
        if self.channel is not None:
            await self.channel.close()
