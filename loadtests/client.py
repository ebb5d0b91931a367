"""Backends: how a benchmark request becomes an HTTP request, and how its stream is read.

Every backend streams (server-sent events, `data: {json}` lines ending with `data: [DONE]`),
because time to first token and inter-token latency need chunk arrival times. Ids:
`openai` (POST /v1/completions), `openai-chat` (POST /v1/chat/completions), `sglang`
(SGLang's native POST /generate).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import aiohttp

from loadtests.workloads.base import Turn

HISTORY_SEP = "\n\n"
"""Between a reply and the next user message when a history is rendered as plain text."""
ERROR_BODY_CHARS = 500
"""Characters of an error response kept in the record."""


@dataclass(frozen=True)
class RequestInput:
    """One turn to send, with the conversation before it as (user text, reply text) pairs."""

    turn: Turn
    history: tuple[tuple[str, str], ...] = ()


@dataclass
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass
class StreamOutcome:
    """What came back, with perf_counter() times."""

    success: bool
    start: float
    end: float
    text: str = ""
    chunk_times: list[float] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    error: str = ""
    status: int | None = None
    server_timing_ms: dict[str, float] = field(default_factory=dict)
    """The response's `Server-Timing` durations by name (radixmesh: `tokenize`), in ms."""


def parse_server_timing(header: str) -> dict[str, float]:
    """`Server-Timing: tokenize;dur=3.2, other;desc="x";dur=1` -> {"tokenize": 3.2, "other": 1.0}."""
    timings: dict[str, float] = {}
    for metric in header.split(","):
        name, *params = (part.strip() for part in metric.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if name and key.strip().lower() == "dur":
                with contextlib.suppress(ValueError):
                    timings[name] = float(value.strip().strip('"'))
    return timings


class StreamError(Exception):
    """An error event inside an otherwise successful stream."""


class BaseBackend(ABC):
    """Builds a backend's request body and reads its stream.

    `parse_event` gets each decoded `data:` JSON object and returns the newly generated
    text in it ("" for none); it records token counts into `usage` as they appear and
    raises StreamError for an error event.
    """

    name: ClassVar[str]
    path: ClassVar[str]
    supports_token_ids: ClassVar[bool] = True

    def __init__(self, base_url: str, model: str | None = None, headers: dict[str, str] | None = None,
                 extra_body: dict[str, Any] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + self.path
        self.model = model or "default"
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.extra_body = extra_body or {}

    @abstractmethod
    def build_payload(self, req: RequestInput) -> dict[str, Any]: ...

    async def aclose(self) -> None:
        """Release what the backend opened in the run's event loop (gRPC channels); HTTP backends hold nothing."""
        return None

    @abstractmethod
    def parse_event(self, event: dict[str, Any], text_so_far: str, usage: Usage) -> str: ...

    async def send(self, http: aiohttp.ClientSession, req: RequestInput) -> StreamOutcome:
        payload = {**self.build_payload(req), **self.extra_body}
        start = time.perf_counter()
        outcome = StreamOutcome(success=False, start=start, end=start)
        try:
            async with http.post(self.url, json=payload, headers=self.headers) as resp:
                outcome.status = resp.status
                outcome.server_timing_ms = parse_server_timing(resp.headers.get("Server-Timing", ""))
                if resp.status != 200:
                    body = (await resp.text())[:ERROR_BODY_CHARS]
                    outcome.error = f"HTTP {resp.status}: {body}"
                else:
                    await self._read_stream(resp, outcome)
                    outcome.success = True
        except StreamError as exc:
            outcome.error = f"stream error: {exc}"
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            outcome.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        outcome.end = time.perf_counter()
        return outcome

    async def _read_stream(self, resp: aiohttp.ClientResponse, outcome: StreamOutcome) -> None:
        async for raw in resp.content:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue  # blank separators, comments, `event:` lines
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            new_text = self.parse_event(json.loads(data), outcome.text, outcome.usage)
            if new_text:
                outcome.chunk_times.append(time.perf_counter())
                outcome.text += new_text


def render_history_text(req: RequestInput) -> str:
    """A conversation as one completion prompt: each reply follows its prompt directly, as generated."""
    assert isinstance(req.turn.prompt, str), "a rendered history needs text prompts"
    parts = [user + reply + HISTORY_SEP for user, reply in req.history]
    return "".join(parts) + req.turn.prompt


def _prompt(req: RequestInput) -> str | list[int]:
    if isinstance(req.turn.prompt, list):
        assert not req.history, "token-id prompts cannot carry a history"
        return req.turn.prompt
    return render_history_text(req)


def _raise_on_error(event: dict[str, Any]) -> None:
    if event.get("error"):
        err = event["error"]
        raise StreamError(err.get("message", str(err)) if isinstance(err, dict) else str(err))


def _read_openai_usage(event: dict[str, Any], usage: Usage) -> None:
    raw = event.get("usage")
    if not isinstance(raw, dict):
        return
    usage.prompt_tokens = raw.get("prompt_tokens", usage.prompt_tokens)
    usage.completion_tokens = raw.get("completion_tokens", usage.completion_tokens)
    details = raw.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        usage.cached_tokens = details["cached_tokens"]


class CompletionsBackend(BaseBackend):
    name = "openai"
    path = "/v1/completions"

    def build_payload(self, req: RequestInput) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model, "prompt": _prompt(req), "max_tokens": req.turn.output_len,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
        }
        if req.turn.ignore_eos:
            body["ignore_eos"] = True
        if req.turn.response_format is not None:
            body["response_format"] = req.turn.response_format
        return body

    def parse_event(self, event: dict[str, Any], text_so_far: str, usage: Usage) -> str:
        _raise_on_error(event)
        _read_openai_usage(event, usage)
        choices = event.get("choices") or []
        return str(choices[0].get("text") or "") if choices else ""


class ChatBackend(BaseBackend):
    name = "openai-chat"
    path = "/v1/chat/completions"
    supports_token_ids = False

    def build_payload(self, req: RequestInput) -> dict[str, Any]:
        assert isinstance(req.turn.prompt, str), "the chat backend sends text only"
        messages: list[dict[str, str]] = []
        for user, reply in req.history:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        messages.append({"role": "user", "content": req.turn.prompt})
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": req.turn.output_len,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
        }
        if req.turn.ignore_eos:
            body["ignore_eos"] = True
        if req.turn.response_format is not None:
            body["response_format"] = req.turn.response_format
        return body

    def parse_event(self, event: dict[str, Any], text_so_far: str, usage: Usage) -> str:
        _raise_on_error(event)
        _read_openai_usage(event, usage)
        choices = event.get("choices") or []
        if not choices:
            return ""
        delta = choices[0].get("delta") or {}
        return str(delta.get("content") or "")


class NativeBackend(BaseBackend):
    """SGLang's /generate: each event's `text` is the whole output so far (a delta is accepted too)."""

    name = "sglang"
    path = "/generate"

    def build_payload(self, req: RequestInput) -> dict[str, Any]:
        prompt = _prompt(req)
        sampling: dict[str, Any] = {"max_new_tokens": req.turn.output_len, "temperature": 0.0,
                                    "ignore_eos": req.turn.ignore_eos}
        if req.turn.response_format is not None:
            schema = req.turn.response_format.get("json_schema", {}).get("schema", {})
            sampling["json_schema"] = json.dumps(schema)
        key = "input_ids" if isinstance(prompt, list) else "text"
        return {key: prompt, "sampling_params": sampling, "stream": True}

    def parse_event(self, event: dict[str, Any], text_so_far: str, usage: Usage) -> str:
        _raise_on_error(event)
        meta = event.get("meta_info") or {}
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            if meta.get(name) is not None:
                setattr(usage, name, int(meta[name]))
        text = str(event.get("text") or "")
        return text[len(text_so_far):] if text.startswith(text_so_far) else text


BACKENDS: dict[str, type[BaseBackend]] = {b.name: b for b in (CompletionsBackend, ChatBackend, NativeBackend)}
"""Backend id -> class."""


GRPC_BACKEND_IDS = ("grpc", "grpc-chat")
"""Backends of the public gRPC API (loadtests.grpc_client), imported only when used."""


def make_backend(name: str, base_url: str, model: str | None = None, headers: dict[str, str] | None = None,
                 extra_body: dict[str, Any] | None = None, grpc_target: str | None = None,
                 grpc_ca: str | None = None) -> BaseBackend:
    if name in GRPC_BACKEND_IDS:
        from loadtests.grpc_client import GRPC_BACKENDS

        return GRPC_BACKENDS[name](base_url, model=model, headers=headers, extra_body=extra_body,
                                   grpc_target=grpc_target, grpc_ca=grpc_ca)
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose from {', '.join([*BACKENDS, *GRPC_BACKEND_IDS])}")
    return BACKENDS[name](base_url, model=model, headers=headers, extra_body=extra_body)


TokenCounter = Callable[[str], int]
