"""One HTTP request's ext_proc stream: headers, buffered body, the pick.

The proxy sends the request headers (answered at once, unchanged), then the whole body (the filter's
request_body_mode BUFFERED); the answer to the body carries the pick, as a header mutation (the headers have
not left the proxy yet) and as dynamic metadata. A request without a body (a GET), or from a proxy that says
it sends none, is picked on its headers, by load. Every other message (response headers or bodies, trailers,
when a proxy is configured to send them) is answered without a change. The stream ends when the proxy is done
with the request; the pick's in-flight count is released then.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from radixmesh.common.errors import RadixMeshError
from radixmesh.protocol import ext_proc_pb2 as pb
from radixmesh.router.epp import metrics, wire
from radixmesh.router.epp.config import EppConfig
from radixmesh.router.epp.picker import EndpointPicker, Pick
from radixmesh.router.epp.prompt import PromptInput, none, prompt_of
from radixmesh.router.epp.tokens import PromptTokenizer
from radixmesh.router.policies.base import RouteRequest

logger = logging.getLogger(__name__)


class _Exchange:
    """What one stream has seen so far."""

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        self.body = bytearray()
        self.body_too_large = False
        self.pick: Pick | None = None
        self.answered = False
        """The pick (or its refusal) was sent: later body messages change nothing."""
        self.no_body = False
        """The proxy said it sends no request body (its protocol configuration): pick on the headers."""


class ExtProcService:
    """envoy.service.ext_proc.v3.ExternalProcessor/Process over one picker."""

    def __init__(self, config: EppConfig, picker: EndpointPicker, tokenizer: PromptTokenizer, block_size: int) -> None:
        self.config = config
        self.picker = picker
        self.tokenizer = tokenizer
        self.block_size = block_size
        self._warned_mode = False
        for result in metrics.RESULTS:  # the series exist before the first request
            metrics.PICKS.labels(result)

    async def process(self, requests: AsyncIterator[pb.ProcessingRequest],
                      context: Any) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = _Exchange()
        try:
            async for message in requests:
                answer = await self._answer(message, exchange)
                if answer is not None and not message.observability_mode:
                    yield answer
        finally:
            if exchange.pick is not None:
                self.picker.release(exchange.pick)

    async def _answer(self, message: pb.ProcessingRequest, exchange: _Exchange) -> pb.ProcessingResponse | None:
        kind = message.WhichOneof("request")
        if message.HasField("protocol_config"):
            exchange.no_body = message.protocol_config.request_body_mode == pb.NONE
            self._check_mode(message.protocol_config)
        if exchange.subset is None:
            exchange.subset = wire.subset_of(message)
        if kind == "request_headers":
            exchange.headers = wire.headers_of(message.request_headers)
            if message.request_headers.end_of_stream or exchange.no_body:
                return await self._pick(exchange, none("no request body"), on_headers=True)
            return wire.CONTINUE[kind]
        if kind == "request_body" and not exchange.answered:
            self._add_body(exchange, message.request_body.body)
            if not message.request_body.end_of_stream:
                return wire.CONTINUE[kind]
            body = bytes(exchange.body)
            prompt = none("the body is too large to parse") if exchange.body_too_large else prompt_of(body)
            return await self._pick(exchange, prompt, on_headers=False)
        return wire.CONTINUE.get(kind or "")

    def _add_body(self, exchange: _Exchange, chunk: bytes) -> None:
        if exchange.body_too_large or len(exchange.body) + len(chunk) > self.config.max_body_bytes:
            exchange.body_too_large = True
            exchange.body.clear()
            return
        exchange.body += chunk

    async def _pick(self, exchange: _Exchange, prompt: PromptInput, on_headers: bool) -> pb.ProcessingResponse:
        exchange.answered = True
        started = time.perf_counter()
        adapter = self.picker.adapter_of(prompt.model)
        tokens = await self.tokenizer.tokens(prompt, adapter)
        picking = time.perf_counter()
        metrics.TOKENIZE.observe(picking - started)
        rid = exchange.headers.get("x-request-id") or uuid.uuid4().hex
        request = RouteRequest(rid, tokens.num_tokens, tokens.block_hashes, self.block_size, adapter)
        try:
            pick = await self.picker.pick(request, exchange.subset)
        except RadixMeshError as exc:
            answer = wire.immediate(exc)
            logger.info("epp: %s: %s", rid, exc.message)
        else:
            exchange.pick = pick
            metrics.PROMPTS.labels(tokens.source).inc()
            answer = wire.picked(pick.destination, on_headers)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("epp: %s (%d tokens, %s) -> %s: %s", rid, tokens.num_tokens, tokens.source,
                             pick.destination, pick.decision.attributes())
        metrics.PICK.observe(time.perf_counter() - picking)
        return answer

    def _check_mode(self, protocol: pb.ProtocolConfiguration) -> None:
        if protocol.request_body_mode != pb.BUFFERED and not self._warned_mode:
            self._warned_mode = True
            mode = pb.BodySendMode.Name(protocol.request_body_mode)
            logger.warning("epp: the proxy sends request bodies in mode %s; the picker needs BUFFERED (the pick is "
                           "set as a header, which only a buffered body's answer can still change)", mode)
