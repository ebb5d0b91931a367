"""The gateway's copy of the tokenizer service's tokenizer: GetTokenizerFiles, loading the files back with the
fingerprint check, and local detokenization giving the service's Detokenize text message for message."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from radixmesh.common.errors import RadixMeshError
from radixmesh.gateway.detokenizers import LocalText, fetch_tokenizer
from radixmesh.protocol import common_pb2, tokenizer_pb2, worker_pb2
from radixmesh.tokenizer_service.files import load_from_files, saved_files
from radixmesh.tokenizer_service.service import DetokenizeSession, TokenizerServicer
from radixmesh.wire.fingerprint import tokenizer_fingerprint
from radixmesh.wire.sampling import SamplingParams
from tests.unit.test_detokenizer import SAMPLES, byte_level_tokenizer, metaspace_tokenizer


class _Stub:
    """The tokenizer service's GetTokenizerFiles, called in process (what the gateway's stub reaches)."""

    def __init__(self, servicer: TokenizerServicer) -> None:
        self.servicer = servicer

    async def GetTokenizerFiles(self, request: Any, timeout: float) -> tokenizer_pb2.GetTokenizerFilesResponse:
        method = TokenizerServicer.GetTokenizerFiles.__wrapped__  # type: ignore[attr-defined]
        response: tokenizer_pb2.GetTokenizerFilesResponse = await method(self.servicer, request, None)
        return response


@pytest.mark.parametrize("make", [byte_level_tokenizer, metaspace_tokenizer], ids=["byte-level", "metaspace"])
def test_the_copy_has_the_services_fingerprint_and_decodes_the_same(make: Any) -> None:
    original = make()
    servicer = TokenizerServicer(original, "m")
    copy = asyncio.run(fetch_tokenizer(_Stub(servicer), "tokenizer:1"))
    assert tokenizer_fingerprint(copy) == servicer.fingerprint
    for text in SAMPLES:
        ids = original.encode(text)
        assert copy.encode(text) == ids
        assert copy.decode(ids, skip_special_tokens=True) == original.decode(ids, skip_special_tokens=True)


def test_files_with_a_path_or_another_fingerprint_are_refused() -> None:
    tokenizer = byte_level_tokenizer()
    files = saved_files(tokenizer)
    assert files and all("/" not in name for name, _ in files)
    fingerprint = tokenizer_fingerprint(tokenizer)
    with pytest.raises(RadixMeshError, match="not a plain file name"):
        load_from_files([("../tokenizer.json", files[0][1])], fingerprint)
    with pytest.raises(RadixMeshError, match="fingerprint"):
        load_from_files(files, "0" * 64)
    with pytest.raises(RadixMeshError, match="no tokenizer files"):
        load_from_files([], fingerprint)
    other = saved_files(metaspace_tokenizer())
    with pytest.raises(RadixMeshError, match="fingerprint"):
        load_from_files(other, fingerprint)


def _messages(ids: list[int], sizes: list[int], finish: int,
              stop_token: int | None) -> list[worker_pb2.GenerateResponse]:
    """The worker's stream of `ids`: messages of the given sizes (cycled), the last one finishing."""
    messages, start, i = [], 0, 0
    body = ids + ([stop_token] if stop_token is not None else [])
    while start < len(body):
        end = min(start + sizes[i % len(sizes)], len(body))
        messages.append(worker_pb2.GenerateResponse(token_ids=body[start:end]))
        start, i = end, i + 1
    messages[-1].finish_reason = finish
    if stop_token is not None:
        messages[-1].matched_stop_token_id = stop_token
    return messages


@pytest.mark.parametrize("stop", [(), ("END",), ("42", "ça")])
@pytest.mark.parametrize("stop_token", [False, True])
def test_local_text_equals_the_services_detokenize_stream(stop: tuple[str, ...], stop_token: bool) -> None:
    tokenizer = byte_level_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    finish = common_pb2.FINISH_REASON_STOP if stop_token else common_pb2.FINISH_REASON_LENGTH
    for text in SAMPLES:
        for sizes in ([1], [2, 3], [5]):
            messages = _messages(tokenizer.encode(text), sizes, finish, eos if stop_token else None)
            session = DetokenizeSession(tokenizer, tokenizer_pb2.DetokenizeStart(request_id="r", stop=list(stop)))
            local = LocalText(tokenizer, "r", SamplingParams(stop=stop))
            for msg in messages:
                ends_with_stop = msg.HasField("matched_stop_token_id")
                expected = session.feed(tokenizer_pb2.DetokenizeTokens(
                    token_ids=msg.token_ids, finish_reason=msg.finish_reason, ends_with_stop_token=ends_with_stop))
                assert asyncio.run(local.text(msg)) == expected.text, (text, sizes, stop)
