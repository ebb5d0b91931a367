"""Prompt tokenization off the serving event loop: a pool of threads that batch-encode what waits.

A front end (`radixmesh serve`'s, the tokenizer service) awaits `TokenizerPool.encode`; the text goes
to a worker thread, so the loop keeps streaming other requests' tokens while a long prompt tokenizes.
Hugging Face's Rust tokenizer releases the GIL inside `encode_batch` (not inside `encode`), so the
workers run in parallel with the loop and with each other. Texts that arrive while every worker is busy
wait together and are encoded in one `encode_batch` call by the next free worker: no timer, no added
latency when a worker is idle. A long text is cut into pieces that the other threads encode at the same
time, where the tokenizer gives the same ids that way (`split_encode`).

Each text is encoded exactly once, through the Rust tokenizer itself: transformers' `tokenizer.encode`
wraps the same `encode_batch` call in Python-side conversions (attention masks, type ids, a
`BatchEncoding`) that cost about as much again on a 4k-token prompt.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from radixmesh.common import tracing
from radixmesh.common.errors import invalid_argument
from radixmesh.engine.hf_tokenizer import render_chat
from radixmesh.engine.split_encode import SplitEncoder, can_split, default_min_piece_chars


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which a container's cpuset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


DEFAULT_TOKENIZER_WORKERS = max(4, min(8, usable_cores() // 2))
"""Threads of a front end's tokenizer pool: 4, up to 8 on hosts of 10+ cores (a long prompt's pieces spread over
idle workers)."""
MAX_TOKENIZER_WORKERS = 64
MAX_BATCH_TEXTS = 64
"""Most waiting texts one worker takes at once."""

T = TypeVar("T")


def check_num_workers(num_workers: int, param: str = "tokenizer_workers") -> None:
    if not 1 <= num_workers <= MAX_TOKENIZER_WORKERS:
        raise invalid_argument(f"{param} must be in [1, {MAX_TOKENIZER_WORKERS}] (got {num_workers})", param)


def batch_encoder(tokenizer: Any, piece_executor: Executor | None = None, max_pieces: int = 1,
                  spare_threads: Callable[[], int] | None = None) -> Callable[[Sequence[str], bool], list[list[int]]]:
    """`encode(texts, add_special_tokens) -> ids per text`, the same ids as `tokenizer.encode(text, ...)`.

    A transformers fast tokenizer is encoded through its Rust tokenizer's `encode_batch` (which releases
    the GIL), with the settings transformers would apply first: no truncation, no padding, its
    `split_special_tokens`; a long text in up to `max_pieces` pieces, the later ones on `piece_executor`, when
    the tokenizer gives the same ids that way (`split_encode.can_split`), and no more pieces than one plus
    `spare_threads()`. Other tokenizers go through their own `encode`, one text at a time.
    """
    backend: Any = getattr(tokenizer, "_tokenizer", None)
    if not getattr(tokenizer, "is_fast", False) or not hasattr(backend, "encode_batch"):
        def encode_each(texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
            return [list(tokenizer.encode(text, add_special_tokens=add_special_tokens)) for text in texts]

        return encode_each
    # transformers sets these on the shared Rust tokenizer before every call with default arguments;
    # done once here, so the calls below (and transformers' own, later) never change it mid-encode
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    split_special = bool(getattr(tokenizer, "split_special_tokens", False))
    if hasattr(backend, "encode_special_tokens") and backend.encode_special_tokens != split_special:
        backend.encode_special_tokens = split_special
    if piece_executor is not None and max_pieces > 1 and can_split(backend):
        return SplitEncoder(backend, piece_executor, max_pieces, default_min_piece_chars(usable_cores()),
                            spare_threads=spare_threads)

    encode_fast = getattr(backend, "encode_batch_fast", backend.encode_batch)  # fast: no character offsets

    def encode_batch(texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        return [e.ids for e in encode_fast(list(texts), add_special_tokens=add_special_tokens)]

    return encode_batch


@dataclass(frozen=True)
class Encoded(Generic[T]):
    """One prompt's tokenization."""

    ids: list[int]
    text: str
    """The text that was encoded (for a conversation: its rendering in the chat template)."""
    queued_s: float
    """Time from `encode` to a worker taking the text."""
    encode_s: float
    """The worker's time for the batch that held it (rendering and `after` included)."""
    extra: T
    """What `after(ids)` returned on the worker (None without `after`)."""


async def traced(span_name: str, kind: str, encoding: Awaitable[Encoded[T]],
                 attributes: dict[str, Any] | None = None) -> Encoded[T]:
    """A pool encode awaited in a `span_name` span when tracing is on (`tokenize.input` = `kind` and `attributes`,
    then the prompt's tokens, blocks where `after` hashed them, and the queue and encode times)."""
    if not tracing.enabled():
        return await encoding
    with tracing.span(span_name, {"tokenize.input": kind, **(attributes or {})}) as span:
        encoded = await encoding
        if span is not None:
            span.set_attributes({"tokenize.prompt_tokens": len(encoded.ids),
                                 **({"tokenize.num_blocks": len(encoded.extra)} if isinstance(encoded.extra, list)
                                    else {}),
                                 "tokenize.queued_ms": round(encoded.queued_s * 1e3, 3),
                                 "tokenize.encode_ms": round(encoded.encode_s * 1e3, 3)})
    return encoded


@dataclass
class _Job:
    text: str
    messages: list[dict[str, Any]] | None
    add_generation_prompt: bool
    add_special_tokens: bool
    after: Callable[[list[int]], Any] | None
    future: asyncio.Future[Encoded[Any]]
    tools: list[dict[str, Any]] | None = None
    submitted_s: float = field(default_factory=time.perf_counter)


class TokenizerPool:
    """Encodes prompts on `num_workers` threads; methods are called from one event loop."""

    def __init__(self, tokenizer: Any, num_workers: int = DEFAULT_TOKENIZER_WORKERS) -> None:
        check_num_workers(num_workers)
        self.tokenizer = tokenizer
        self.num_workers = num_workers
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="tokenize")
        self._piece_executor = ThreadPoolExecutor(num_workers - 1, thread_name_prefix="tokenize-piece") \
            if num_workers > 1 else None
        """Encodes the later pieces of long texts while a worker encodes their first (`split_encode`)."""
        self._encode = batch_encoder(tokenizer, self._piece_executor, num_workers, self._num_idle)
        self._waiting: list[_Job] = []
        self._num_busy = 0
        self.num_texts = 0
        """Texts encoded so far (each prompt's text counts once)."""
        self.num_batches = 0
        """`encode_batch` calls so far (a batch holds the texts that waited together)."""

    def _num_idle(self) -> int:
        """Workers without a batch now (read on a worker: an int the loop thread writes)."""
        return max(0, self.num_workers - self._num_busy)

    async def encode(self, text: str, add_special_tokens: bool = True,
                     after: Callable[[list[int]], T] | None = None) -> Encoded[T]:
        """Token ids of `text` (`after(ids)`, when given, runs on the worker too, e.g. block hashes)."""
        return await self._submit(text, None, True, add_special_tokens, after)

    async def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                          after: Callable[[list[int]], T] | None = None,
                          tools: list[dict[str, Any]] | None = None) -> Encoded[T]:
        """Token ids of a conversation rendered in the chat template (which writes the special tokens);
        `tools` (OpenAI's shape) go to a template that takes them."""
        return await self._submit("", messages, add_generation_prompt, False, after, tools)

    async def _submit(self, text: str, messages: list[dict[str, Any]] | None, add_generation_prompt: bool,
                      add_special_tokens: bool, after: Callable[[list[int]], Any] | None,
                      tools: list[dict[str, Any]] | None = None) -> Encoded[Any]:
        future: asyncio.Future[Encoded[Any]] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Job(text, messages, add_generation_prompt, add_special_tokens, after, future, tools))
        self._dispatch()
        return await future

    def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting and self._num_busy < self.num_workers:
            batch = [job for job in self._waiting[:MAX_BATCH_TEXTS] if not job.future.done()]
            del self._waiting[:MAX_BATCH_TEXTS]
            if not batch:
                continue
            self._num_busy += 1
            work = loop.run_in_executor(self._executor, self._run, batch)
            work.add_done_callback(functools.partial(self._finish, batch, time.perf_counter()))

    def _run(self, batch: list[_Job]) -> tuple[list[list[int] | Exception], list[Any], float]:
        """On a worker: render conversations, encode by add_special_tokens, run `after`; errors per job."""
        start = time.perf_counter()
        results: list[list[int] | Exception] = [[] for _ in batch]
        for index, job in enumerate(batch):
            if job.messages is not None:
                try:
                    job.text = render_chat(self.tokenizer, job.messages, job.add_generation_prompt, job.tools)
                except Exception as exc:  # the template's error, for this job alone
                    results[index] = exc
        for special in (True, False):
            indices = [i for i, job in enumerate(batch)
                       if job.add_special_tokens == special and not isinstance(results[i], Exception)]
            if indices:
                for i, ids in zip(indices, self._encode([batch[i].text for i in indices], special)):
                    results[i] = ids
        extras: list[Any] = [None] * len(batch)
        for index, job in enumerate(batch):
            result = results[index]
            if job.after is not None and not isinstance(result, Exception):
                try:
                    extras[index] = job.after(result)
                except Exception as exc:
                    results[index] = exc
        return results, extras, time.perf_counter() - start

    def _finish(self, batch: list[_Job], taken_s: float, done: asyncio.Future[Any]) -> None:
        self._num_busy -= 1
        self.num_batches += 1
        self.num_texts += len(batch)
        error = done.exception() if not done.cancelled() else asyncio.CancelledError()
        if error is not None:  # the worker itself failed (not one job): every job gets the error
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(error)
        else:
            results, extras, encode_s = done.result()
            for job, result, extra in zip(batch, results, extras):
                if job.future.done():  # its caller went away
                    continue
                if isinstance(result, Exception):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(Encoded(result, job.text, taken_s - job.submitted_s, encode_s, extra))
        if self._waiting:
            self._dispatch()

    def close(self) -> None:
        """Stop the workers (a batch being encoded finishes first)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._piece_executor is not None:
            self._piece_executor.shutdown(wait=False, cancel_futures=True)
