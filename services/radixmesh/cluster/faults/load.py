"""Bounded HTTP load against a gateway: a fixed number of concurrent clients, a cap on requests,
and a deadline per request, each request's outcome recorded.

Outcomes: completed (HTTP 200 and, when streamed, `[DONE]` with no error frame); failed (an HTTP
error, an SSE error frame, a refused or reset connection, a stream cut before `[DONE]`: the client
learns it failed); hung (no end within the deadline: lost); aborted (the client went away on
purpose).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from radixmesh.common import aio

STARTED_MARKERS = ("mid-stream", "after it started")
"""Words of the router's and gateway's errors for a stream that had begun: its tokens were under way to the
client (on a loaded machine they can trail the fault) and it could not be moved to another worker."""


@dataclass(frozen=True)
class RequestSpec:
    """One request to send."""

    kind: str
    """Label in the results (chat-stream, completion, ...)."""
    path: str
    """/v1/chat/completions or /v1/completions."""
    body: dict[str, Any]
    abort_after_frames: int | None = None
    """Streamed: close the connection after this many data frames (a client that goes away)."""

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class RequestRecord:
    kind: str
    sent_s: float
    """Seconds since the load started."""
    first_frame_s: float | None = None
    end_s: float | None = None
    outcome: str = "hung"
    error: str = ""
    index: int = -1
    """The index its spec was made for (the same index makes the same request)."""
    frame_s: list[float] = field(default_factory=list)
    """Streamed: when each frame with generated tokens arrived (seconds since the load started)."""
    num_tokens: int = 0
    """Streamed with log-probs: tokens received (one log-prob entry each)."""
    text: str = ""
    """Streamed: the generated text, as the client assembled it."""
    completion_tokens: int | None = None
    """The usage the server reported (streamed with include_usage)."""


def chat_stream(index: int, max_tokens: int, **extra: Any) -> RequestSpec:
    """A streamed chat request whose prompt differs per index (so no two share a whole prompt); greedy, exactly
    `max_tokens` tokens, each with its log-prob (the client counts the tokens it gets) and the usage at the end."""
    body = {"messages": [{"role": "user", "content": f"Request {index}: list some facts about the number {index}."}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True, "logprobs": True,
            "stream_options": {"include_usage": True}}
    return RequestSpec("chat-stream", "/v1/chat/completions", {**body, **extra})


class LoadGen:
    """`concurrency` clients sending `make_spec(i)` for i = 0, 1, ... until `max_requests` or `stop()`."""

    def __init__(self, base_url: str, make_spec: Callable[[int], RequestSpec], concurrency: int,
                 max_requests: int, timeout_s: float, pause_after_failure_s: float = 1.0) -> None:
        self.base_url = base_url
        self.make_spec = make_spec
        self.concurrency = concurrency
        self.max_requests = max_requests
        self.timeout_s = timeout_s
        self.pause_after_failure_s = pause_after_failure_s
        """A client that saw a failure waits this long before its next request (as a real one would)."""
        self.records: list[RequestRecord] = []
        self._next = 0
        self._stopped = False
        self._start = time.monotonic()

    def now_s(self) -> float:
        return time.monotonic() - self._start

    def stop(self) -> None:
        """No new requests from now on (those under way finish or time out)."""
        self._stopped = True

    @property
    def num_streaming(self) -> int:
        """Requests under way that have received generated text."""
        return sum(1 for r in self.records if r.end_s is None and r.first_frame_s is not None)

    @property
    def num_completed(self) -> int:
        return sum(1 for r in self.records if r.outcome == "completed")

    async def run(self) -> list[RequestRecord]:
        self._start = time.monotonic()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=None, limits=limits) as client:
            await asyncio.gather(*(self._client(client) for _ in range(self.concurrency)))
        return self.records

    async def _client(self, client: httpx.AsyncClient) -> None:
        while not self._stopped and self._next < self.max_requests:
            spec = self.make_spec(self._next)
            record = RequestRecord(spec.kind, self.now_s(), index=self._next)
            self._next += 1
            self.records.append(record)
            try:
                await aio.wait_for(self._send(client, spec, record), self.timeout_s)
            except TimeoutError:
                record.outcome, record.error = "hung", f"no end within {self.timeout_s:.0f} s"
                continue
            except (httpx.HTTPError, OSError) as exc:
                record.outcome, record.error = "failed", f"{type(exc).__name__}: {exc}"[:200]
            record.end_s = self.now_s()
            if record.outcome == "failed":
                await asyncio.sleep(self.pause_after_failure_s)

    async def _send(self, client: httpx.AsyncClient, spec: RequestSpec, record: RequestRecord) -> None:
        if not spec.stream:
            response = await client.post(spec.path, json=spec.body)
            record.first_frame_s = self.now_s()
            _finish(record, response.status_code, response.text)
            return
        async with client.stream("POST", spec.path, json=spec.body) as response:
            if response.status_code != 200:
                _finish(record, response.status_code, (await response.aread()).decode(errors="replace"))
                return
            await self._read_events(response, spec, record)

    async def _read_events(self, response: httpx.Response, spec: RequestSpec, record: RequestRecord) -> None:
        num_frames = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                record.outcome = "failed" if record.error else "completed"
                return
            if "error" in (payload := json.loads(data)):
                record.error = f"error frame: {json.dumps(payload['error'])[:200]}"
                continue
            num_frames += 1
            _take_frame(record, payload, self.now_s())
            if spec.abort_after_frames is not None and num_frames >= spec.abort_after_frames:
                record.outcome = "aborted"
                return  # leaving the `stream` block closes the connection
        record.outcome, record.error = "failed", record.error or "stream ended without [DONE]"


def _take_frame(record: RequestRecord, payload: dict[str, Any], now_s: float) -> None:
    """Add a frame's text, tokens (log-prob entries) and usage to the record; time the frames with tokens."""
    if payload.get("usage"):
        record.completion_tokens = int(payload["usage"].get("completion_tokens", 0))
    num_tokens, text = 0, ""
    for choice in payload.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        logprobs = choice.get("logprobs") or {}
        num_tokens += len(logprobs.get("content") or logprobs.get("tokens") or [])
    record.text += text
    record.num_tokens += num_tokens
    if text or num_tokens:
        record.frame_s.append(now_s)
        if record.first_frame_s is None:
            record.first_frame_s = now_s


def _finish(record: RequestRecord, status: int, text: str) -> None:
    if status == 200:
        record.outcome = "completed"
    else:
        record.outcome, record.error = "failed", f"HTTP {status}: {text[:200]}"


def summarize(records: list[RequestRecord], fault_s: float | None = None) -> dict[str, Any]:
    """Counts by outcome; with `fault_s` (seconds since the load started), failures among the requests that
    had received no text when the fault began (sent later, or still waiting for their first token), and of
    those the ones the system did not report as started (could have been re-routed)."""
    def count(outcome: str) -> int:
        return sum(1 for r in records if r.outcome == outcome)

    latencies = [r.end_s - r.sent_s for r in records if r.outcome == "completed" and r.end_s is not None]
    errors: dict[str, int] = {}
    for r in records:
        if r.outcome in ("failed", "hung"):
            errors[r.error] = errors.get(r.error, 0) + 1
    summary: dict[str, Any] = {
        "sent": len(records), "completed": count("completed"), "failed_clear": count("failed"),
        "hung": count("hung"), "aborted": count("aborted"),
        "latency_p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:4])}
    if fault_s is not None:
        no_text = [r for r in records if r.outcome in ("failed", "hung") and (r.end_s is None or r.end_s >= fault_s)
                   and (r.first_frame_s is None or r.first_frame_s > fault_s)]
        summary["failed_no_text_at_fault"] = len(no_text)
        summary["failed_not_started"] = sum(1 for r in no_text if not any(m in r.error for m in STARTED_MARKERS))
        failed_at = [r.end_s for r in records if r.outcome == "failed" and r.end_s is not None and r.end_s >= fault_s]
        summary["first_failure_s"] = round(min(failed_at) - fault_s, 3) if failed_at else None
    return summary
