"""`RuntimeEndpoint`: programs run against a radixmesh server (`radixmesh serve` or a gateway).

The wire format is the SGLang-native API: `/generate` (with `return_logprob` and
`logprob_start_len` for `select`), plus `/tokenize` and `/apply_chat_template` so the
client needs no tokenizer of its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.lang.backend import BaseBackend, GenResult, SelectResult
from radixmesh.lang.chat import RoleMarkerCache
from radixmesh.lang.ir import GenParams

_STATUS_CODES = {400: ErrorCode.INVALID_ARGUMENT, 401: ErrorCode.UNAUTHENTICATED, 404: ErrorCode.NOT_FOUND,
                 429: ErrorCode.RESOURCE_EXHAUSTED, 503: ErrorCode.UNAVAILABLE}
SCORE_PARAMS = {"max_new_tokens": 1, "temperature": 0}
"""A scoring request only needs its prefill; the one token it samples is ignored."""


class RuntimeEndpoint(BaseBackend):
    """A radixmesh server at `base_url` (e.g. http://127.0.0.1:8000); `api_key` if it requires one."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0,
                 max_connections: int = 256, transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s,
                                  limits=httpx.Limits(max_connections=max_connections), transport=transport)
        self._markers = RoleMarkerCache(self._render_chat)
        self.model_info: dict[str, Any] = self._call("GET", "/model_info")
        """The server's /model_info (model_path, context_len, ...), fetched once: it proves the server answers."""

    # ---- BaseBackend ----------------------------------------------------------------------------
    def generate(self, prompt: str, params: GenParams,
                 on_text: Callable[[str], None] | None = None) -> GenResult:
        body = {"text": prompt, "sampling_params": params.to_wire()}
        start = time.perf_counter()
        if on_text is None:
            result = self._call("POST", "/generate", body)
        else:
            result, streamed = {}, ""
            for result in self._stream_events(body):
                text = result.get("text", "")
                if len(text) > len(streamed):  # each event carries the whole text so far
                    on_text(text[len(streamed):])
                    streamed = text
            if not result:
                raise RadixMeshError(ErrorCode.INTERNAL, "the server ended the stream without a result")
        return GenResult(result["text"], result["meta_info"], start, time.perf_counter())

    def select(self, prompt: str, choices: tuple[str, ...]) -> SelectResult:
        tokenized = self._call("POST", "/tokenize", {"prompt": [prompt, *(prompt + c for c in choices)]})["tokens"]
        prefix, full = tokenized[0], tokenized[1:]
        # Score from where the choice's tokens begin: normally the prefix's length, earlier when
        # the prefix's last token merges with the choice's first one.
        starts = [min(_common_prefix_len(prefix, ids), len(ids) - 1) for ids in full]
        body = {"input_ids": full, "sampling_params": SCORE_PARAMS, "return_logprob": True,
                "logprob_start_len": starts}
        results = self._call("POST", "/generate", body)
        scored = [[lp for lp, *_ in r["meta_info"]["input_token_logprobs"] if lp is not None] for r in results]
        totals = [sum(lps) for lps in scored]
        best = max(range(len(totals)), key=lambda i: (totals[i], -i))
        return SelectResult(best, totals, [len(lps) for lps in scored], [r["meta_info"] for r in results])

    def cache_prefix(self, prompt: str) -> None:
        self._call("POST", "/generate", {"text": prompt, "sampling_params": SCORE_PARAMS})

    def role_markers(self, history: tuple[str, ...], role: str) -> tuple[str, str]:
        return self._markers.get(history, role)

    # ---- HTTP -----------------------------------------------------------------------------------
    def _render_chat(self, messages: list[dict[str, str]]) -> str:
        text: str = self._call("POST", "/apply_chat_template",
                               {"messages": messages, "add_generation_prompt": False})["text"]
        return text

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            response = self._http.request(method, path, json=body)
        except httpx.TransportError as exc:
            raise RadixMeshError(ErrorCode.UNAVAILABLE, f"cannot reach {self.base_url}{path}: {exc}") from None
        if response.status_code >= 400:
            raise _error(response.status_code, response.content)
        return response.json()

    def _stream_events(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The SSE events of a streamed /generate (each carries the cumulative text)."""
        try:
            with self._http.stream("POST", "/generate", json={**body, "stream": True}) as response:
                if response.status_code >= 400:
                    raise _error(response.status_code, response.read())
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:"):].strip()
                    if payload == "[DONE]":
                        return
                    event = json.loads(payload)
                    if "error" in event:
                        raise _error(500, payload.encode())
                    yield event
        except httpx.TransportError as exc:
            raise RadixMeshError(ErrorCode.UNAVAILABLE, f"cannot reach {self.base_url}/generate: {exc}") from None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RuntimeEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _error(status: int, content: bytes) -> RadixMeshError:
    """The server's error body ({"error": {message, param, code}}) as the domain error."""
    try:
        error = json.loads(content)["error"]
        message, param, code = str(error["message"]), error.get("param"), error.get("code")
    except (ValueError, KeyError, TypeError):
        message, param, code = content.decode(errors="replace")[:500] or f"HTTP {status}", None, None
    values = {c.value for c in ErrorCode}
    if code in values:
        kind = ErrorCode(code)
    elif code == "invalid_api_key":
        kind = ErrorCode.UNAUTHENTICATED
    else:
        kind = _STATUS_CODES.get(status, ErrorCode.INTERNAL)
    return RadixMeshError(kind, message, param)
