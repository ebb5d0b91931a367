"""GrammarService.Compile: one compilation per content key, shared through memory and Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc.aio
from prometheus_client import Counter, Histogram

from radixmesh.common import tracing
from radixmesh.common.errors import invalid_argument
from radixmesh.common.grpc_errors import map_errors
from radixmesh.common.metrics import GRAMMAR_COMPILE_BUCKETS_S
from radixmesh.engine.grammar.base import BaseGrammarBackend
from radixmesh.engine.grammar.remote import PROTO_KINDS
from radixmesh.engine.grammar.spec import GrammarSpec
from radixmesh.grammar_service.store import GrammarStore
from radixmesh.protocol import grammar_pb2, grammar_pb2_grpc

SERVICE_NAME = grammar_pb2.DESCRIPTOR.services_by_name["GrammarService"].full_name
KIND_FROM_PROTO = {grammar_pb2.GrammarKind.Value(name): kind for kind, name in PROTO_KINDS.items()}
_SOURCES = {"compiled": grammar_pb2.GRAMMAR_SOURCE_COMPILED, "memory": grammar_pb2.GRAMMAR_SOURCE_MEMORY,
            "redis": grammar_pb2.GRAMMAR_SOURCE_REDIS}
MAX_VOCAB_SIZE = 1 << 22

COMPILES = Counter("radixmesh_grammar_compile_requests_total", "Compile calls answered, by where the grammar came from",
                   ["source"])
COMPILE_SECONDS = Histogram("radixmesh_grammar_compile_seconds", "Time to compile one grammar",
                            buckets=GRAMMAR_COMPILE_BUCKETS_S)
for _source in _SOURCES:  # compiled | memory | redis (the last two are cache hits): series from the start
    COMPILES.labels(_source)


class GrammarServicer(grammar_pb2_grpc.GrammarServiceServicer):
    """Compiles for one tokenizer; a backend per (vocab size, stop ids) the callers ask for."""

    def __init__(self, tokenizer: Any, fingerprint: str, backend_cls: type[BaseGrammarBackend], store: GrammarStore,
                 default_vocab_size: int, default_stop_ids: Sequence[int], num_threads: int = 2) -> None:
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.backend_cls = backend_cls
        self.store = store
        self.default_vocab_size = default_vocab_size
        self.default_stop_ids = tuple(default_stop_ids)
        self.num_threads = num_threads
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="radixmesh-grammar-compile")
        self._backends: dict[tuple[int, tuple[int, ...]], asyncio.Future[BaseGrammarBackend]] = {}
        self._in_flight: dict[str, asyncio.Future[bytes]] = {}

    @map_errors("grammar")
    async def Compile(self, request: grammar_pb2.CompileRequest,
                      context: grpc.aio.ServicerContext) -> grammar_pb2.CompileResponse:
        spec = self._spec(request)
        if request.tokenizer_fingerprint and request.tokenizer_fingerprint != self.fingerprint:
            raise invalid_argument("tokenizer_fingerprint does not match this grammar service's tokenizer "
                                   f"({self.fingerprint[:12]}...): it compiles for another model",
                                   "tokenizer_fingerprint")
        vocab_size = request.vocab_size or self.default_vocab_size
        if not 1 <= vocab_size <= MAX_VOCAB_SIZE:
            raise invalid_argument(f"vocab_size must be in [1, {MAX_VOCAB_SIZE}]", "vocab_size")
        stop_ids = tuple(request.stop_token_ids) or self.default_stop_ids
        backend = await self._backend(vocab_size, stop_ids)
        version = backend.serialization_version
        key = spec.content_key(self.fingerprint, version, vocab_size, stop_ids)
        start = time.perf_counter()
        hit = await self.store.get(key)
        if hit is not None:
            data, source = hit
        else:
            data, source = await self._compile_once(key, spec, backend)
        COMPILES.labels(source).inc()
        compile_ms = (time.perf_counter() - start) * 1000 if source == "compiled" else 0.0
        if tracing.enabled():
            tracing.set_attributes({"grammar.kind": spec.kind, "grammar.source": source,
                                    "grammar.compile_ms": compile_ms, "grammar.bytes": len(data)})
        return grammar_pb2.CompileResponse(compiled_grammar=data, content_key=key, serialization_version=version,
                                           source=_SOURCES[source], compile_ms=compile_ms)

    def _spec(self, request: grammar_pb2.CompileRequest) -> GrammarSpec:
        kind = KIND_FROM_PROTO.get(request.kind)
        if kind is None:
            raise invalid_argument("kind must be one of JSON_SCHEMA, REGEX, EBNF, ANY_JSON, STRUCTURAL_TAG", "kind")
        spec = GrammarSpec.parse(kind, request.spec)
        self.backend_cls.check_syntax(spec)
        return spec

    async def _backend(self, vocab_size: int, stop_ids: tuple[int, ...]) -> BaseGrammarBackend:
        """The backend for this vocabulary; built once (reading the vocabulary takes a moment)."""
        key = (vocab_size, stop_ids)
        fut = self._backends.get(key)
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = asyncio.ensure_future(loop.run_in_executor(
                self._executor, lambda: self.backend_cls(self.tokenizer, vocab_size, list(stop_ids),
                                                         num_threads=self.num_threads)))
            self._backends[key] = fut
        try:
            return await asyncio.shield(fut)
        except Exception:
            self._backends.pop(key, None)
            raise

    async def _compile_once(self, key: str, spec: GrammarSpec, backend: BaseGrammarBackend) -> tuple[bytes, str]:
        """Compile on a worker thread; concurrent calls for one key share the compilation."""
        fut = self._in_flight.get(key)
        if fut is not None:
            return await asyncio.shield(fut), "memory"
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._in_flight[key] = fut
        try:
            with COMPILE_SECONDS.time():
                data = await loop.run_in_executor(self._executor, lambda: backend.serialize(backend.compile(spec)))
            await self.store.put(key, data)
            fut.set_result(data)
            return data, "compiled"
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters re-raise it, nobody else must
            raise
        finally:
            self._in_flight.pop(key, None)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
