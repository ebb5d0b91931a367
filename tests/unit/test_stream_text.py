"""The cluster gateway's detokenizers (gateway/detokenizers.py): the text of a worker's stream in this process
or through the tokenizer service's Detokenize stream, the stop token left out, and a tokenizer that goes away
becoming its UNAVAILABLE error."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import grpc.aio
import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.gateway.detokenizers import LocalText, ServiceText
from radixmesh.protocol import common_pb2, tokenizer_pb2, worker_pb2
from radixmesh.wire.sampling import SamplingParams

from .test_detokenizer import byte_level_tokenizer


def msg(ids: list[int], finish: int = common_pb2.FINISH_REASON_UNSPECIFIED,
        stop_token: int | None = None) -> worker_pb2.GenerateResponse:
    out = worker_pb2.GenerateResponse(token_ids=ids, finish_reason=finish)
    if stop_token is not None:
        out.matched_stop_token_id = stop_token
    return out


def test_local_text_streams_the_whole_text_and_drops_the_stop_token() -> None:
    tokenizer = byte_level_tokenizer()
    ids = list(tokenizer.encode("the quick brown fox", add_special_tokens=False))
    stop = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text = LocalText(tokenizer, "r", SamplingParams(skip_special_tokens=False))

    async def run() -> list[str]:
        pieces = [await text.text(msg([i])) for i in ids]
        pieces.append(await text.text(msg([stop], common_pb2.FINISH_REASON_STOP, stop)))
        await text.finish()
        text.close()
        return pieces

    assert "".join(asyncio.run(run())) == "the quick brown fox"


def test_local_text_cuts_at_a_stop_string() -> None:
    tokenizer = byte_level_tokenizer()
    ids = list(tokenizer.encode("hello world, END here", add_special_tokens=False))
    text = LocalText(tokenizer, "r", SamplingParams(stop=("END",)))

    async def run() -> str:
        body = "".join([await text.text(msg([i])) for i in ids[:-1]])
        return body + await text.text(msg(ids[-1:], common_pb2.FINISH_REASON_STOP))

    assert asyncio.run(run()) == "hello world, "


class FakeDetokenize:
    """The service's Detokenize bidi stream: echoes each message's ids as text, or fails as told."""

    def __init__(self, fail_read: grpc.RpcError | None = None, end_early: bool = False) -> None:
        self.written: list[tokenizer_pb2.DetokenizeRequest] = []
        self.fail_read, self.end_early = fail_read, end_early
        self.cancelled = self.half_closed = False

    async def write(self, request: tokenizer_pb2.DetokenizeRequest) -> None:
        self.written.append(request)

    async def read(self) -> Any:
        if self.fail_read is not None:
            raise self.fail_read
        if self.end_early or self.half_closed:
            return grpc.aio.EOF
        last = self.written[-1].tokens
        suffix = "|stop" if last.ends_with_stop_token else ""
        return tokenizer_pb2.DetokenizeResponse(text=",".join(map(str, last.token_ids)) + suffix)

    async def done_writing(self) -> None:
        self.half_closed = True

    def cancel(self) -> None:
        self.cancelled = True

    async def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    async def details(self) -> str:
        return "the tokenizer restarted"

    async def trailing_metadata(self) -> Any:
        return ()


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection reset"

    def trailing_metadata(self) -> Any:
        return ()


def service_text(call: FakeDetokenize, params: SamplingParams | None = None) -> tuple[ServiceText, list[str]]:
    errors: list[str] = []

    def on_error(exc: grpc.RpcError) -> RadixMeshError:
        errors.append(str(exc.details()))
        return RadixMeshError(ErrorCode.UNAVAILABLE, f"tokenizer: {exc.details()}")

    stub = type("Stub", (), {"Detokenize": lambda self: call})()
    return ServiceText(stub, "r", params or SamplingParams(stop=("x",), skip_special_tokens=False), on_error), errors


def test_service_text_starts_the_stream_then_sends_each_message() -> None:
    call = FakeDetokenize()

    async def run() -> list[str]:
        text, _ = service_text(call)
        pieces = [await text.text(msg([1, 2])), await text.text(msg([3], common_pb2.FINISH_REASON_STOP, 3))]
        await text.finish()
        text.close()
        return pieces

    assert asyncio.run(run()) == ["1,2", "3|stop"]
    start = call.written[0].start
    assert (start.request_id, list(start.stop), start.skip_special_tokens) == ("r", ["x"], False)
    assert call.written[2].tokens.finish_reason == common_pb2.FINISH_REASON_STOP and call.half_closed
    assert call.cancelled  # close() always cancels: a no-op on a finished call


def test_a_tokenizer_that_fails_mid_stream_is_its_unavailable_error() -> None:
    call = FakeDetokenize(fail_read=Unavailable())

    async def run() -> None:
        text, errors = service_text(call)
        try:
            await text.text(msg([1]))
        finally:
            text.close()
        assert errors == ["connection reset"]

    with pytest.raises(RadixMeshError) as info:
        asyncio.run(run())
    assert info.value.code is ErrorCode.UNAVAILABLE and "connection reset" in info.value.message


def test_a_stream_that_ends_without_a_reply_reports_its_status() -> None:
    call = FakeDetokenize(end_early=True)

    async def run() -> None:
        text, _ = service_text(call)
        try:
            await text.text(msg([1]))
        finally:
            text.close()

    with pytest.raises(RadixMeshError, match="the tokenizer restarted"):
        asyncio.run(run())


def test_closing_before_the_start_was_written_leaves_nothing_behind() -> None:
    call = FakeDetokenize()

    async def run() -> None:
        text, _ = service_text(call)
        text.close()  # the request failed before its first token: the start write never runs
        await asyncio.sleep(0)

    asyncio.run(run())
    assert call.cancelled and call.written == []
