"""Turning a worker's token stream into text, for the gateway: in this process from a copy of the tokenizer
service's tokenizer ("local"), or through the service's Detokenize stream ("service").

Both give the same text: the same `TextAssembler` (incremental detokenization, stop strings) runs here or
in the service, over a tokenizer with the same fingerprint. Local saves a gRPC round trip per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import grpc
import grpc.aio

from radixmesh.common import aio
from radixmesh.common.errors import RadixMeshError
from radixmesh.common.grpc_errors import from_rpc_error
from radixmesh.engine.output import TextAssembler
from radixmesh.protocol import common_pb2, tokenizer_pb2, worker_pb2
from radixmesh.wire.convert import finish_reason_from_proto
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.sampling import SamplingParams

logger = logging.getLogger(__name__)
END_TIMEOUT_S = 10.0
"""Bound on reading the end of a finished Detokenize stream."""
FILES_TIMEOUT_S = 60.0
"""Bound on GetTokenizerFiles (a large vocabulary is ~10 MB)."""


class StreamText(Protocol):
    """One output stream's text, message by message."""

    async def text(self, msg: worker_pb2.GenerateResponse) -> str: ...

    async def finish(self) -> None: ...

    def close(self) -> None: ...


def _stop_token(msg: worker_pb2.GenerateResponse) -> bool:
    """The message ends with the stop token that finished the sequence (its text is not part of the output)."""
    return (msg.finish_reason == common_pb2.FINISH_REASON_STOP and msg.HasField("matched_stop_token_id")
            and len(msg.token_ids) > 0)


class LocalText:
    """Detokenizes in this process with the gateway's copy of the tokenizer."""

    def __init__(self, tokenizer: Any, rid: str, params: SamplingParams) -> None:
        self.rid = rid
        self.assembler = TextAssembler(tokenizer, params)

    async def text(self, msg: worker_pb2.GenerateResponse) -> str:
        ids = list(msg.token_ids)
        stop = _stop_token(msg)
        out = TokenOut(self.rid, ids, 0, 0, 0, finish_reason=finish_reason_from_proto(msg.finish_reason),
                       matched_stop=ids[-1] if stop else None)
        return self.assembler.feed(out).text

    async def finish(self) -> None:
        return None

    def close(self) -> None:
        return None


class ServiceText:
    """Detokenizes through the tokenizer service's Detokenize stream (one round trip per message). The stream
    opens at once, while the prompt is computed, so the first token does not wait for it."""

    def __init__(self, stub: Any, rid: str, params: SamplingParams,
                 on_error: Callable[[grpc.RpcError], RadixMeshError]) -> None:
        self._call = stub.Detokenize()
        self._on_error = on_error
        start = tokenizer_pb2.DetokenizeStart(request_id=rid, skip_special_tokens=params.skip_special_tokens,
                                              stop=list(params.stop))
        self._started = asyncio.ensure_future(self._write(tokenizer_pb2.DetokenizeRequest(start=start)))

    async def _write(self, request: tokenizer_pb2.DetokenizeRequest) -> None:
        # The write is made inside this coroutine, not up front: a request that fails before the task runs
        # cancels it, and a write coroutine made earlier would then never be awaited.
        await self._step(self._call.write(request))

    async def _step(self, step: Awaitable[Any]) -> Any:
        """One write or read; a tokenizer that went away (the RPC failed, or finished under the write) becomes
        the tokenizer's UNAVAILABLE error, never a raw exception."""
        try:
            return await step
        except grpc.RpcError as exc:
            raise self._on_error(exc) from None
        except asyncio.InvalidStateError:
            raise self._on_error(await _status_error(self._call)) from None

    async def text(self, msg: worker_pb2.GenerateResponse) -> str:
        await self._started
        tokens = tokenizer_pb2.DetokenizeTokens(token_ids=msg.token_ids, finish_reason=msg.finish_reason,
                                                ends_with_stop_token=_stop_token(msg))
        await self._step(self._call.write(tokenizer_pb2.DetokenizeRequest(tokens=tokens)))
        response = await self._step(self._call.read())
        if response is grpc.aio.EOF:
            raise self._on_error(await _status_error(self._call))
        return str(response.text)

    async def finish(self) -> None:
        """Half-close and read the end, so the call finishes OK (its trace span too) instead of being cancelled.
        The text is complete by then: a tokenizer failing to say goodbye is not the client's error."""
        with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError):
            await self._call.done_writing()
            await aio.wait_for(self._call.read(), END_TIMEOUT_S)

    def close(self) -> None:
        self._call.cancel()
        if not self._started.done():
            self._started.cancel()
        elif not self._started.cancelled():
            self._started.exception()  # collected, never left unretrieved


async def fetch_tokenizer(stub: Any, peer: str) -> Any:
    """A local copy of the tokenizer service's tokenizer, fingerprint-checked (errors as RadixMeshError)."""
    from radixmesh.tokenizer_service.files import load_from_files

    try:
        response = await stub.GetTokenizerFiles(tokenizer_pb2.GetTokenizerFilesRequest(), timeout=FILES_TIMEOUT_S)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, peer) from None
    files = [(f.name, bytes(f.data)) for f in response.files]
    return await asyncio.to_thread(load_from_files, files, response.fingerprint)


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


async def _status_error(call: Any) -> grpc.RpcError:
    return _StreamFailed(await call.code(), await call.details(), await call.trailing_metadata())
