"""Load control: Poisson (or immediate) session arrivals, a concurrency cap, warm-up requests.

A session's turns go one after another (each needs the previous reply), so at most one
request per session is in flight and --max-concurrency bounds both sessions and requests.
Arrival times come from the seed, so two runs of one workload send at the same moments.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loadtests.client import BaseBackend, RequestInput, StreamOutcome
from loadtests.records import RequestResult
from loadtests.workloads.base import Session, Turn, Workload

SKIPPED_ERROR = "not sent: an earlier turn of its session failed"
WARMUP_TURN = Turn(prompt="This is a warm-up request; reply with anything.", prompt_len=12, output_len=4)
"""Sent before the timed run. It shares no text with any workload, so it cannot inflate cache hits."""


@dataclass(frozen=True)
class LoadConfig:
    """How the workload is offered to the server."""

    request_rate: float = math.inf
    """Session arrivals per second (Poisson); inf sends every session at once."""
    max_concurrency: int | None = None
    """Most sessions (so requests) in flight; None is no cap."""
    num_warmup: int = 1
    """Requests sent and awaited before the timed run; their results are dropped."""
    seed: int = 0
    """Seeds the arrival times."""
    request_timeout_s: float = 600.0
    """Total time allowed to one request."""
    show_progress: bool = True
    """Draw a progress bar on stderr."""
    flush_cache: bool = False
    """POST /flush_cache after the warm-up, so the run starts with an empty prefix cache."""

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmup < 0:
            raise ValueError(f"--warmup-requests must be >= 0, got {self.num_warmup}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout-s must be > 0, got {self.request_timeout_s}")

    def to_dict(self) -> dict[str, Any]:
        rate = "inf" if math.isinf(self.request_rate) else self.request_rate
        return {"request_rate": rate, "max_concurrency": self.max_concurrency, "num_warmup": self.num_warmup,
                "seed": self.seed, "request_timeout_s": self.request_timeout_s, "flush_cache": self.flush_cache}


@dataclass
class RunRecord:
    """One timed run: every request's result and the run's length."""

    results: list[RequestResult]
    duration_s: float
    warmup_errors: list[str] = field(default_factory=list)
    flush_error: str | None = None
    """Why POST /flush_cache failed (None: it worked or was not asked for)."""
    clock_origin_s: float | None = None
    """`time.perf_counter()` when the run started: each request's `start_s` counts from it (the host's monotonic
    clock, which the server's request and step traces on the same machine read too)."""


def arrival_times_s(num: int, rate: float, seed: int) -> list[float]:
    """Offsets of `num` arrivals: the first at 0, then exponential gaps of mean 1 / rate."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    times, now = [], 0.0
    for i in range(num):
        if i:
            now += rng.expovariate(rate)
        times.append(now)
    return times


async def run_load(workload: Workload, backend: BaseBackend, load: LoadConfig,
                   count_tokens: Callable[[str], int]) -> RunRecord:
    """Warm up, then offer every session at its arrival time; returns once all have finished."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=load.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=load.max_concurrency or 0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        warmup_errors = await _warm_up(http, backend, load.num_warmup)
        flush_error = await _flush_cache(http, backend) if load.flush_cache else None
        runner = _SessionRunner(http, backend, count_tokens, load, workload.num_requests)
        start = time.perf_counter()
        runner.start = start
        with runner.progress_bar():
            tasks = []
            for session, offset in zip(workload.sessions, arrival_times_s(len(workload.sessions),
                                                                         load.request_rate, load.seed)):
                delay = start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(runner.run_session(session)))
            per_session = await asyncio.gather(*tasks)
        await backend.aclose()
    results = [r for session_results in per_session for r in session_results]
    end = max((r.end_s for r in results), default=0.0)
    return RunRecord(results=results, duration_s=end, warmup_errors=warmup_errors, flush_error=flush_error,
                     clock_origin_s=start)


async def _warm_up(http: Any, backend: BaseBackend, num: int) -> list[str]:
    outcomes = await asyncio.gather(*(backend.send(http, RequestInput(turn=WARMUP_TURN)) for _ in range(num)))
    return [o.error for o in outcomes if not o.success]


async def _flush_cache(http: Any, backend: BaseBackend) -> str | None:
    import aiohttp

    try:
        async with http.post(backend.base_url + "/flush_cache", headers=backend.headers) as resp:
            return None if resp.status == 200 else f"HTTP {resp.status}: {(await resp.text())[:200]}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}"


class _SessionRunner:
    def __init__(self, http: Any, backend: BaseBackend, count_tokens: Callable[[str], int], load: LoadConfig,
                 num_requests: int) -> None:
        self.http = http
        self.backend = backend
        self.count_tokens = count_tokens
        self.load = load
        self.num_requests = num_requests
        self.semaphore = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
        self.start = 0.0
        self._bar: Any = None

    @contextlib.contextmanager
    def progress_bar(self) -> Any:
        if not self.load.show_progress:
            yield
            return
        from tqdm import tqdm

        self._bar = tqdm(total=self.num_requests, desc="requests", unit="req")
        try:
            yield
        finally:
            self._bar.close()

    async def run_session(self, session: Session) -> list[RequestResult]:
        async with self.semaphore or contextlib.nullcontext():
            return await self._send_turns(session)

    async def _send_turns(self, session: Session) -> list[RequestResult]:
        results: list[RequestResult] = []
        history: list[tuple[str, str]] = []
        history_len = 0  # tokens of the history, for when the server reports no prompt count
        for index, turn in enumerate(session.turns):
            if results and not results[-1].success:
                results.append(self._skipped(session, index))
                continue
            outcome = await self.backend.send(self.http, RequestInput(turn=turn, history=tuple(history)))
            result = self._to_result(session, index, outcome, history_len + turn.prompt_len)
            result.max_output_len = turn.output_len
            results.append(result)
            if isinstance(turn.prompt, str):
                history.append((turn.prompt, outcome.text))
            history_len = result.prompt_len + result.output_len
            if self._bar is not None:
                self._bar.update(1)
        return results

    def _to_result(self, session: Session, index: int, outcome: StreamOutcome, prompt_len: int) -> RequestResult:
        usage, times = outcome.usage, outcome.chunk_times
        output_len = usage.completion_tokens
        if output_len is None:
            output_len = self.count_tokens(outcome.text) if outcome.text else 0
        return RequestResult(
            session_id=session.session_id, turn_index=index, success=outcome.success,
            prompt_len=usage.prompt_tokens if usage.prompt_tokens is not None else prompt_len,
            output_len=output_len, start_s=outcome.start - self.start, latency_s=outcome.end - outcome.start,
            ttft_s=times[0] - outcome.start if times else None,
            itl_s=[b - a for a, b in itertools.pairwise(times)], cached_len=usage.cached_tokens,
            error=outcome.error, status=outcome.status, group_id=session.group_id, output_text=outcome.text,
            tokenize_s=_ms_to_s(outcome.server_timing_ms.get("tokenize")))

    def _skipped(self, session: Session, index: int) -> RequestResult:
        if self._bar is not None:
            self._bar.update(1)
        now = time.perf_counter() - self.start
        return RequestResult(session_id=session.session_id, turn_index=index, success=False,
                             prompt_len=session.turns[index].prompt_len, output_len=0, start_s=now, latency_s=0.0,
                             max_output_len=session.turns[index].output_len,
                             error=SKIPPED_ERROR, group_id=session.group_id)


def _ms_to_s(value_ms: float | None) -> float | None:
    return None if value_ms is None else value_ms / 1e3
