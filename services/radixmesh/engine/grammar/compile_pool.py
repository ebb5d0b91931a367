"""Grammar compilation off the scheduler thread, once per content.

A spec is compiled on a worker thread (xgrammar releases the GIL while compiling), so
the scheduler keeps stepping other requests. Identical specs share one compilation,
in flight or finished; finished grammars stay in an LRU of `cache_size` entries.
When a remote source (the grammar service) is set, it is asked first and local
compilation is the fallback.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from radixmesh.common.metrics import GRAMMAR_COMPILE_BUCKETS_S, BucketCounts
from radixmesh.engine.grammar.base import BaseGrammarBackend
from radixmesh.engine.grammar.spec import GrammarSpec

logger = logging.getLogger(__name__)


class RemoteGrammarSource(Protocol):
    """Where compiled grammars can be fetched instead of compiled (the grammar service)."""

    def fetch(self, spec: GrammarSpec, backend: BaseGrammarBackend) -> bytes:
        """Serialized compiled grammar for `spec`; raises when the source cannot provide it."""


class GrammarCompilePool:
    """Futures of compiled grammars keyed by spec content; thread-safe."""

    def __init__(self, make_backend: Callable[[], BaseGrammarBackend], num_threads: int, cache_size: int,
                 remote: RemoteGrammarSource | None = None) -> None:
        self._make_backend = make_backend
        self._backend: BaseGrammarBackend | None = None
        self._executor = ThreadPoolExecutor(max(num_threads, 1), thread_name_prefix="radixmesh-grammar")
        self._cache_size = cache_size
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._in_flight: dict[str, Future[Any]] = {}
        self._lock = threading.Lock()
        self._backend_lock = threading.Lock()
        self._remote = remote
        self.num_compiled = 0
        self.num_fetched = 0
        self.num_cache_hits = 0
        self.num_remote_failures = 0
        self.compile_time = BucketCounts(GRAMMAR_COMPILE_BUCKETS_S)
        """Seconds from the start of a compilation to its grammar (fetched or compiled here)."""

    @property
    def backend(self) -> BaseGrammarBackend:
        """The backend, built on first use (reading the vocabulary takes a moment)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    @property
    def has_backend(self) -> bool:
        return self._backend is not None

    def get(self, spec: GrammarSpec) -> Future[Any]:
        """A future of the compiled grammar; already done when the spec was compiled before."""
        key = spec.local_key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                done: Future[Any] = Future()
                done.set_result(self._cache[key])
                return done
            fut = self._in_flight.get(key)
            if fut is not None:
                self.num_cache_hits += 1
                return fut
            fut = self._executor.submit(self._compile, key, spec)
            self._in_flight[key] = fut  # (under the lock: the worker cannot settle the key before this)
        return fut

    def _compile(self, key: str, spec: GrammarSpec) -> Any:
        """Runs on the pool. The key is settled (cached, or forgotten on failure) before the future completes, so
        whoever sees the result and asks again gets the cache (or, after a failure, a new attempt)."""
        start = time.perf_counter()
        try:
            compiled = self._fetch_or_compile(spec)
        except BaseException:
            with self._lock:
                self._in_flight.pop(key, None)
            raise
        with self._lock:
            self.compile_time.observe(time.perf_counter() - start)
            self._in_flight.pop(key, None)
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _fetch_or_compile(self, spec: GrammarSpec) -> Any:
        backend = self.backend
        if self._remote is not None:
            try:
                compiled = backend.deserialize(self._remote.fetch(spec, backend))
                self.num_fetched += 1
                return compiled
            except Exception as exc:  # the service is optional: any failure falls back to compiling here
                self.num_remote_failures += 1
                logger.warning("grammar service failed (%s); compiling locally", exc)
        compiled = backend.compile(spec)
        self.num_compiled += 1
        return compiled

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
