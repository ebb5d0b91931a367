"""Fetching compiled grammars from the grammar service (engine/grammar/remote.py) over a stand-in stub: the request
names the kind, the tokenizer's fingerprint and the vocabulary; an unreachable service is not asked again for a
while; a serialization this engine cannot read is refused."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from radixmesh.engine.grammar import remote
from radixmesh.engine.grammar.remote import GrammarServiceClient, GrammarServiceUnavailable
from radixmesh.engine.grammar.spec import GrammarSpec
from radixmesh.protocol import grammar_pb2


class Failure(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "nope"


class Stub:
    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.requests: list[grammar_pb2.CompileRequest] = []

    def Compile(self, request: grammar_pb2.CompileRequest, timeout: float) -> Any:
        self.requests.append(request)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


BACKEND = SimpleNamespace(serialization_version="v7")


def client(stub: Stub) -> GrammarServiceClient:
    c = GrammarServiceClient("127.0.0.1:1", tokenizer=None, vocab_size=100, stop_token_ids=[2, 3], timeout_s=1.5)
    c._stub, c._fingerprint = stub, "fp"  # connected already (no channel is dialled here)
    return c


def reply(data: bytes = b"grammar", version: str = "v7") -> grammar_pb2.CompileResponse:
    return grammar_pb2.CompileResponse(compiled_grammar=data, serialization_version=version)


@pytest.mark.parametrize(("kind", "proto_kind"), [("json_schema", "GRAMMAR_KIND_JSON_SCHEMA"),
                                                  ("regex", "GRAMMAR_KIND_REGEX"), ("ebnf", "GRAMMAR_KIND_EBNF"),
                                                  ("json", "GRAMMAR_KIND_ANY_JSON")])
def test_a_compiled_grammar_comes_back_for_each_kind(kind: str, proto_kind: str) -> None:
    stub = Stub([reply(b"compiled")])
    assert client(stub).fetch(GrammarSpec(kind, "src"), BACKEND) == b"compiled"  # type: ignore[arg-type]
    (request,) = stub.requests
    assert request.kind == grammar_pb2.GrammarKind.Value(proto_kind) and request.spec == "src"
    assert (request.tokenizer_fingerprint, request.vocab_size, list(request.stop_token_ids)) == ("fp", 100, [2, 3])


def test_an_unreachable_service_is_not_asked_again_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(remote.time, "monotonic", lambda: now[0])
    stub = Stub([Failure(grpc.StatusCode.UNAVAILABLE), reply()])
    c = client(stub)
    with pytest.raises(GrammarServiceUnavailable, match="UNAVAILABLE"):
        c.fetch(GrammarSpec("regex", "a+"), BACKEND)  # type: ignore[arg-type]
    with pytest.raises(GrammarServiceUnavailable, match="unreachable moments ago"):
        c.fetch(GrammarSpec("regex", "a+"), BACKEND)  # type: ignore[arg-type]
    assert len(stub.requests) == 1  # the second call did not reach the service
    now[0] += remote.RETRY_AFTER_S + 1
    assert c.fetch(GrammarSpec("regex", "a+"), BACKEND) == b"grammar"  # type: ignore[arg-type]


def test_a_refusal_by_the_service_is_not_a_reason_to_stop_asking() -> None:
    stub = Stub([Failure(grpc.StatusCode.INVALID_ARGUMENT), reply()])
    c = client(stub)
    with pytest.raises(GrammarServiceUnavailable, match="INVALID_ARGUMENT"):
        c.fetch(GrammarSpec("regex", "("), BACKEND)  # type: ignore[arg-type]
    assert c.fetch(GrammarSpec("regex", "a"), BACKEND) == b"grammar"  # type: ignore[arg-type]


def test_a_grammar_serialized_for_another_backend_version_is_refused() -> None:
    stub = Stub([reply(version="v6")])
    with pytest.raises(ValueError, match="serializes as v6, this engine reads v7"):
        client(stub).fetch(GrammarSpec("regex", "a"), BACKEND)  # type: ignore[arg-type]
