"""Fetching compiled grammars from the grammar service (`--grammar-service ADDR`).

Called on the scheduler's compile threads (blocking gRPC). Any failure raises, and the
compile pool then compiles locally; after the service is found unreachable it is not
asked again for `RETRY_AFTER_S`, so a dead service costs one failed call, not one per
grammar.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from radixmesh.engine.grammar.base import BaseGrammarBackend
from radixmesh.engine.grammar.spec import GrammarSpec

logger = logging.getLogger(__name__)
RETRY_AFTER_S = 10.0
PROTO_KINDS = {"json_schema": "GRAMMAR_KIND_JSON_SCHEMA", "regex": "GRAMMAR_KIND_REGEX", "ebnf": "GRAMMAR_KIND_EBNF",
          "json": "GRAMMAR_KIND_ANY_JSON", "structural_tag": "GRAMMAR_KIND_STRUCTURAL_TAG"}
"""GrammarKind names of proto/radixmesh/v1/grammar.proto, by spec kind (the grammar service reads them too)."""


class GrammarServiceUnavailable(ConnectionError):
    pass


class GrammarServiceClient:
    """A `RemoteGrammarSource` over gRPC; thread-safe."""

    def __init__(self, address: str, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 timeout_s: float) -> None:
        self.address = address
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._stub: Any = None
        self._fingerprint: str | None = None
        self._down_until = 0.0

    def _connect(self) -> tuple[Any, str]:
        with self._lock:
            if self._stub is None:

                from radixmesh.common import tls
                from radixmesh.protocol import grammar_pb2_grpc
                from radixmesh.wire.fingerprint import tokenizer_fingerprint

                self._fingerprint = tokenizer_fingerprint(self.tokenizer)
                channel = tls.sync_channel(self.address, options=[
                    ("grpc.max_receive_message_length", 256 << 20)])
                self._stub = grammar_pb2_grpc.GrammarServiceStub(channel)
            assert self._fingerprint is not None
            return self._stub, self._fingerprint

    def fetch(self, spec: GrammarSpec, backend: BaseGrammarBackend) -> bytes:
        """The serialized compiled grammar; raises when the service cannot provide a usable one."""
        import grpc

        from radixmesh.protocol import grammar_pb2

        if time.monotonic() < self._down_until:
            raise GrammarServiceUnavailable(f"grammar service {self.address} was unreachable moments ago")
        stub, fingerprint = self._connect()
        kind = grammar_pb2.GrammarKind.Value(PROTO_KINDS[spec.kind])
        request = grammar_pb2.CompileRequest(kind=kind, spec=spec.source, tokenizer_fingerprint=fingerprint,
                                             vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
        try:
            response = stub.Compile(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._down_until = time.monotonic() + RETRY_AFTER_S
            raise GrammarServiceUnavailable(f"grammar service {self.address}: {exc.code().name}: "
                                            f"{exc.details()}") from None
        if response.serialization_version != backend.serialization_version:
            raise ValueError(f"grammar service serializes as {response.serialization_version}, this engine reads "
                             f"{backend.serialization_version}")
        data: bytes = response.compiled_grammar
        return data
