"""TokenizerService: Tokenize, Detokenize (bidirectional stream), Decode, GetTokenizerInfo, GetTokenizerFiles.

Tokenize encodes on a `TokenizerPool` (worker threads that batch what waits together), and the prompt's
block hashes are computed there too: the event loop only parses and answers calls.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc.aio
from prometheus_client import Counter, Histogram

from radixmesh.common import tracing
from radixmesh.common.errors import invalid_argument
from radixmesh.common.grpc_errors import map_errors
from radixmesh.engine.chat_template import takes_tools, template_text, tool_syntax
from radixmesh.engine.hf_tokenizer import decode_text, token_texts
from radixmesh.engine.mm.prompt import MultimodalProcessor
from radixmesh.engine.output import TextAssembler
from radixmesh.engine.tokenize_pool import DEFAULT_TOKENIZER_WORKERS, TokenizerPool
from radixmesh.protocol import common_pb2, multimodal_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from radixmesh.tokenizer_service.files import saved_files
from radixmesh.tokenizer_service.images import chat_messages, text_only, tokenize_with_images
from radixmesh.wire.block_hash import DEFAULT_BLOCK_SIZE, block_hashes
from radixmesh.wire.chat_convert import tools_from_proto
from radixmesh.wire.convert import finish_reason_from_proto, images_to_proto
from radixmesh.wire.fingerprint import tokenizer_fingerprint
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.sampling import SamplingParams

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].full_name
MAX_BLOCK_SIZE = 4096

REQUESTS = Counter("radixmesh_tokenizer_requests_total", "Tokenizer service calls", ["rpc"])
TOKENIZE_SECONDS = Histogram("radixmesh_tokenizer_tokenize_seconds", "Time to tokenize one prompt",
                             buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0))
PROMPT_TOKENS = Counter("radixmesh_tokenizer_prompt_tokens_total", "Prompt tokens produced by Tokenize")
DETOKENIZED_TOKENS = Counter("radixmesh_tokenizer_detokenized_tokens_total",
                             "Output tokens turned into text by Detokenize")


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    """Serves one Hugging Face tokenizer (the model's own)."""

    def __init__(self, tokenizer: Any, model_name: str, block_size: int = DEFAULT_BLOCK_SIZE,
                 tokenizer_path: str = "", images: MultimodalProcessor | None = None,
                 num_workers: int = DEFAULT_TOKENIZER_WORKERS) -> None:
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise invalid_argument(f"block_size must be in [1, {MAX_BLOCK_SIZE}] (got {block_size})", "block_size")
        self.tokenizer = tokenizer
        self.pool = TokenizerPool(tokenizer, num_workers)
        """Encodes prompts (and hashes their blocks) on worker threads."""
        self.model_name = model_name
        self.tokenizer_path = tokenizer_path
        """Where the tokenizer came from (a directory or hub id), reported by GetTokenizerInfo."""
        self.block_size = block_size
        self.vocab_size = len(tokenizer)
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.template = template_text(tokenizer)
        self.images = images
        """Reads and places the images of prompts (None: a text-only model, which refuses them)."""
        self._files: list[tuple[str, bytes]] | None = None
        """What GetTokenizerFiles returns, written once on its first call."""

    @map_errors("tokenizer")
    async def Tokenize(self, request: tokenizer_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> tokenizer_pb2.TokenizeResponse:
        REQUESTS.labels("Tokenize").inc()
        block_size = request.block_size or self.block_size
        if block_size > MAX_BLOCK_SIZE:
            raise invalid_argument(f"block_size must be in [1, {MAX_BLOCK_SIZE}]", "block_size")
        start = time.perf_counter()
        kind = request.WhichOneof("input")
        images: list[multimodal_pb2.ImageInput] = []
        hash_blocks = functools.partial(block_hashes, block_size=block_size, extra_key=request.extra_key)
        if request.images:
            placed = await tokenize_with_images(self.images, request, self.model_name)
            ids, text, images = placed.input_ids, placed.prompt_text, images_to_proto(placed.mm)
            hashes = hash_blocks(ids)
        elif kind == "chat":
            messages = text_only(chat_messages(request.chat))
            add_prompt = request.chat.add_generation_prompt if request.chat.HasField("add_generation_prompt") else True
            encoded = await self.pool.encode_chat(messages, add_prompt, after=hash_blocks,
                                                  tools=tools_from_proto(request.chat))
            ids, text, hashes = encoded.ids, encoded.text, encoded.extra
        elif kind == "text":
            special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            encoded = await self.pool.encode(request.text, special, after=hash_blocks)
            ids, text, hashes = encoded.ids, encoded.text, encoded.extra
        elif kind == "token_ids":
            text, ids = "", list(request.token_ids.ids)
            hashes = hash_blocks(ids)
        else:
            raise invalid_argument("a Tokenize request needs `text` or `chat`", "input")
        TOKENIZE_SECONDS.observe(time.perf_counter() - start)
        PROMPT_TOKENS.inc(len(ids))
        if tracing.enabled():
            tracing.set_attributes({"tokenize.input": kind, "tokenize.prompt_tokens": len(ids),
                                    "tokenize.images": len(request.images),
                                    "tokenize.num_blocks": len(hashes), "tokenize.block_size": block_size})
        return tokenizer_pb2.TokenizeResponse(
            token_ids=ids, prompt_text=text, images=images,
            block_hashes=common_pb2.BlockHashes(block_size=block_size, hashes=hashes))

    @map_errors("tokenizer")
    async def Detokenize(self, request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeRequest],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[tokenizer_pb2.DetokenizeResponse]:
        REQUESTS.labels("Detokenize").inc()
        session: DetokenizeSession | None = None
        async for message in request_iterator:
            kind = message.WhichOneof("kind")
            if kind == "start":
                if session is not None:
                    raise invalid_argument("DetokenizeStart may only be sent once per stream", "start")
                session = DetokenizeSession(self.tokenizer, message.start)
            elif kind == "tokens":
                if session is None:
                    raise invalid_argument("a Detokenize stream must begin with DetokenizeStart", "start")
                self._check_ids(message.tokens.token_ids)
                yield session.feed(message.tokens)
            else:
                raise invalid_argument("empty DetokenizeRequest", "kind")
        if session is not None and tracing.enabled():
            tracing.set_attributes({"radixmesh.request_id": session.request_id,
                                    "detokenize.output_tokens": session.num_tokens,
                                    "detokenize.stopped": session.assembler.stopped})

    @map_errors("tokenizer")
    async def Decode(self, request: tokenizer_pb2.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> tokenizer_pb2.DecodeResponse:
        REQUESTS.labels("Decode").inc()
        ids = list(request.token_ids)
        self._check_ids(ids)
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        response = tokenizer_pb2.DecodeResponse(text=decode_text(self.tokenizer, ids, skip))
        if request.per_token:
            response.token_texts.extend(token_texts(self.tokenizer, ids))
        return response

    @map_errors("tokenizer")
    async def GetTokenizerInfo(self, request: tokenizer_pb2.GetTokenizerInfoRequest,
                               context: grpc.aio.ServicerContext) -> tokenizer_pb2.GetTokenizerInfoResponse:
        REQUESTS.labels("GetTokenizerInfo").inc()
        tok = self.tokenizer
        specials = [tokenizer_pb2.SpecialToken(text=text, token_id=tok.convert_tokens_to_ids(text))
                    for text in tok.all_special_tokens]
        info = tokenizer_pb2.GetTokenizerInfoResponse(
            model_name=self.model_name, vocab_size=self.vocab_size, special_tokens=specials,
            fingerprint=self.fingerprint, has_chat_template=bool(getattr(tok, "chat_template", None)),
            block_size=self.block_size, tokenizer_path=self.tokenizer_path, accepts_images=self.images is not None,
            image_placeholder=self.images.placeholder_text if self.images is not None else "",
            chat_template_takes_tools=takes_tools(self.template), chat_template_tool_syntax=tool_syntax(self.template))
        if tok.bos_token_id is not None:
            info.bos_token_id = tok.bos_token_id
        if tok.eos_token_id is not None:
            info.eos_token_ids.append(tok.eos_token_id)
        return info

    @map_errors("tokenizer")
    async def GetTokenizerFiles(self, request: tokenizer_pb2.GetTokenizerFilesRequest,
                                context: grpc.aio.ServicerContext) -> tokenizer_pb2.GetTokenizerFilesResponse:
        REQUESTS.labels("GetTokenizerFiles").inc()
        files = [tokenizer_pb2.TokenizerFile(name=name, data=data) for name, data in await self._saved_files()]
        return tokenizer_pb2.GetTokenizerFilesResponse(files=files, fingerprint=self.fingerprint)

    async def _saved_files(self) -> list[tuple[str, bytes]]:
        if self._files is not None:
            return self._files
        files: list[tuple[str, bytes]] = await asyncio.to_thread(saved_files, self.tokenizer)
        self._files = files
        return files

    def _check_ids(self, ids: Any) -> None:
        if ids and max(ids) >= self.vocab_size:
            raise invalid_argument(f"token ids must be in [0, {self.vocab_size})", "token_ids")


class DetokenizeSession:
    """One sequence's text: incremental detokenization plus stop-string trimming, as in-process."""

    def __init__(self, tokenizer: Any, start: tokenizer_pb2.DetokenizeStart) -> None:
        skip = start.skip_special_tokens if start.HasField("skip_special_tokens") else True
        stop = tuple(start.stop)
        if not all(stop):
            raise invalid_argument("stop strings must be non-empty", "stop")
        self.request_id = start.request_id
        self.assembler = TextAssembler(tokenizer, SamplingParams(stop=stop, skip_special_tokens=skip))
        self.num_tokens = 0

    def feed(self, tokens: tokenizer_pb2.DetokenizeTokens) -> tokenizer_pb2.DetokenizeResponse:
        ids = list(tokens.token_ids)
        self.num_tokens += len(ids)
        DETOKENIZED_TOKENS.inc(len(ids))
        finish = finish_reason_from_proto(tokens.finish_reason)
        matched = ids[-1] if tokens.ends_with_stop_token and ids else None
        if tokens.ends_with_stop_token and finish is None:
            raise invalid_argument("ends_with_stop_token needs finish_reason STOP", "ends_with_stop_token")
        chunk = self.assembler.feed(TokenOut(self.request_id, ids, 0, 0, 0, finish_reason=finish,
                                             matched_stop=matched))
        return tokenizer_pb2.DetokenizeResponse(text=chunk.text, stopped=self.assembler.stopped)
