"""Test doubles: a word-level tokenizer and a tiny streaming server speaking the three backends.

Used by the unit tests, and handy to try the benchmark without a model.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web

VOCAB_SIZE = 200
SPECIAL_IDS = [0, 1]
TOKENIZE_MS_PER_WORD = 0.01
"""What the fake server reports as its tokenization time, per word of a text prompt."""


class WordTokenizer:
    """Token i is the word `w{i}`; ids 0 and 1 are special (never in random prompts)."""

    all_special_ids = SPECIAL_IDS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(w[1:]) if w.startswith("w") and w[1:].isdigit() else 2 for w in text.split()]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(f"w{i}" for i in token_ids if not (skip_special_tokens and i in SPECIAL_IDS))

    def __len__(self) -> int:
        return VOCAB_SIZE


def _common_prefix_len(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class FakeServer:
    """Streams `max_tokens` words per request; its `cached_tokens` is the longest word prefix
    shared with an earlier prompt, like a radix cache that never evicts."""

    def __init__(self, token_delay_s: float = 0.002, reject_response_format: bool = True) -> None:
        self.token_delay_s = token_delay_s
        self.reject_response_format = reject_response_format
        self.seen: list[list[str]] = []
        self.bodies: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/model_info", self.model_info)
        return app

    def _usage(self, words: list[str], completion_tokens: int) -> dict[str, int]:
        cached = max((_common_prefix_len(words, w) for w in self.seen), default=0)
        self.seen.append(words)
        return {"prompt_tokens": len(words), "completion_tokens": completion_tokens, "cached_tokens": cached}

    async def _stream(self, request: web.Request, num_tokens: int, frame: Any, final: Any,
                      headers: dict[str, str] | None = None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **(headers or {})})
        await resp.prepare(request)
        for i in range(num_tokens):
            await asyncio.sleep(self.token_delay_s)
            await resp.write(f"data: {json.dumps(frame(i))}\n\n".encode())
        if final is not None:
            await resp.write(f"data: {json.dumps(final)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        words = body["text"].split() if "text" in body else [f"w{i}" for i in body["input_ids"]]
        n = body["sampling_params"]["max_new_tokens"]
        usage = self._usage(words, n)

        def frame(i: int) -> dict[str, Any]:
            return {"text": " t" * (i + 1), "meta_info": {**usage, "completion_tokens": i + 1}}

        # as radixmesh reports it: the time a text prompt took to tokenize (here TOKENIZE_MS_PER_WORD per word)
        timing = {"Server-Timing": f"tokenize;dur={TOKENIZE_MS_PER_WORD * len(words):.3f}"} if "text" in body else {}
        return await self._stream(request, n, frame, None, timing)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if "response_format" in body and self.reject_response_format:
            return web.json_response({"error": {"message": "response_format is not supported"}}, status=400)
        prompt = body["prompt"]
        words = prompt.split() if isinstance(prompt, str) else [f"w{i}" for i in prompt]
        return await self._openai_stream(request, words, body["max_tokens"], lambda: {"text": " t"})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if "response_format" in body and self.reject_response_format:
            return web.json_response({"error": {"message": "response_format is not supported"}}, status=400)
        words = " ".join(m["content"] for m in body["messages"]).split()
        return await self._openai_stream(request, words, body["max_tokens"], lambda: {"delta": {"content": " t"}})

    async def _openai_stream(self, request: web.Request, words: list[str], n: int, choice: Any) -> web.StreamResponse:
        usage = self._usage(words, n)
        final = {"choices": [], "usage": {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": n,
                                          "prompt_tokens_details": {"cached_tokens": usage["cached_tokens"]}}}
        return await self._stream(request, n, lambda i: {"choices": [{"index": 0, **choice()}]}, final)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "/nonexistent/fake"})


@contextmanager
def running_fake_server(server: FakeServer) -> Iterator[str]:
    """Serve `server` on 127.0.0.1 in a background thread; yields its base URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(server.app())
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10), "fake server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
