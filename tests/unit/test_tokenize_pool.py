"""Prompt tokenization off the event loop: the pool's ids equal the tokenizer's own, each prompt is encoded
once, on a worker thread, and the loop keeps running while a long prompt encodes."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.hf_tokenizer import encode_chat, encode_text, load_tokenizer
from radixmesh.engine.tokenize_pool import TokenizerPool, batch_encoder

TEXTS = ["Hello, world!", "", "  leading and trailing spaces  ", "héllo wörld — naïve café 你好 🎉",
         "<|im_start|>user\nspecial tokens as text<|im_end|>", "line one\n\nline two\ttab", "a" * 3000,
         "The quick brown fox jumps over the lazy dog. " * 40]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    return load_tokenizer(default_model_dir)


def random_text(tokenizer: Any, num_tokens: int, seed: int = 0) -> str:
    """Text decoded from random ids, as the `random` workload sends it."""
    rng = random.Random(seed)
    specials = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in specials]
    return str(tokenizer.decode([rng.choice(vocab) for _ in range(num_tokens)], skip_special_tokens=True))


class CountingEncoder:
    """Wraps a pool's batch encoder: counts the texts it encodes and records the threads it runs on."""

    def __init__(self, pool: TokenizerPool) -> None:
        self.inner = pool._encode
        self.texts: list[str] = []
        self.threads: set[int] = set()
        pool._encode = self

    def __call__(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        self.texts += texts
        self.threads.add(threading.get_ident())
        return self.inner(texts, add_special_tokens)


def test_batch_encoder_equals_the_tokenizers_encode(tokenizer: Any) -> None:
    encode = batch_encoder(tokenizer)
    texts = [*TEXTS, random_text(tokenizer, 2000)]
    for special in (True, False):
        assert encode(texts, special) == [encode_text(tokenizer, t, special) for t in texts]


def test_pool_ids_equal_direct_tokenization(tokenizer: Any) -> None:
    texts = [*TEXTS, random_text(tokenizer, 4096, seed=1)]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[3]}]

    async def run() -> None:
        pool = TokenizerPool(tokenizer, num_workers=2)
        try:
            encoded = await asyncio.gather(*(pool.encode(t) for t in texts))
            assert [e.ids for e in encoded] == [encode_text(tokenizer, t) for t in texts]
            assert [e.text for e in encoded] == texts
            raw = await pool.encode(TEXTS[0], add_special_tokens=False)
            assert raw.ids == encode_text(tokenizer, TEXTS[0], False)
            chat = await pool.encode_chat(messages)
            assert chat.ids == encode_chat(tokenizer, messages)
            assert "Be brief." in chat.text
            hashed = await pool.encode(TEXTS[-1], after=len)
            assert hashed.extra == len(hashed.ids)
        finally:
            pool.close()

    asyncio.run(run())


def test_each_prompt_is_encoded_once_on_a_worker_thread_and_waiting_prompts_share_a_batch(tokenizer: Any) -> None:
    texts = [f"prompt number {i}: {TEXTS[i % len(TEXTS)]}" for i in range(10)]

    async def run() -> None:
        pool = TokenizerPool(tokenizer, num_workers=1)
        counter = CountingEncoder(pool)
        try:
            await asyncio.gather(*(pool.encode(t) for t in texts))
        finally:
            pool.close()
        assert sorted(counter.texts) == sorted(texts)  # once each
        assert threading.get_ident() not in counter.threads
        # one worker: the first prompt goes alone, the nine that arrived meanwhile go together
        assert (pool.num_texts, pool.num_batches) == (10, 2)

    asyncio.run(run())


def test_the_event_loop_runs_while_a_long_prompt_encodes(tokenizer: Any) -> None:
    """Ticks of a 5 ms timer while ~100k tokens encode: the Rust tokenizer releases the GIL, so the loop
    ticks throughout (an encode that held the loop or the GIL would allow at most one or two)."""
    text = random_text(tokenizer, 2000, seed=2) * 50

    async def run() -> tuple[int, float]:
        pool = TokenizerPool(tokenizer, num_workers=1)
        ticks = 0
        try:
            encoding = asyncio.ensure_future(pool.encode(text))
            start = time.perf_counter()
            while not encoding.done():
                await asyncio.sleep(0.005)
                ticks += 1
            encoded = await encoding
            assert len(encoded.ids) > 50_000
            return ticks, time.perf_counter() - start
        finally:
            pool.close()

    ticks, elapsed_s = asyncio.run(run())
    assert elapsed_s > 0.05, "the text encodes too fast to tell"
    assert ticks >= 10, (ticks, elapsed_s)


def test_a_bad_conversation_fails_alone(tokenizer: Any) -> None:
    async def run() -> None:
        pool = TokenizerPool(tokenizer, num_workers=1)
        try:
            bad = pool.encode_chat([{"role": "user", "content": "hi"}] * 2 + [{"content": "no role"}])
            good = pool.encode("fine")
            results = await asyncio.gather(bad, good, return_exceptions=True)
            assert isinstance(results[0], (RadixMeshError, KeyError, Exception))
            assert not isinstance(results[1], BaseException) and results[1].ids == encode_text(tokenizer, "fine")
        finally:
            pool.close()

    asyncio.run(run())


def test_worker_count_is_checked(tokenizer: Any) -> None:
    with pytest.raises(RadixMeshError, match="tokenizer_workers"):
        TokenizerPool(tokenizer, num_workers=0)
