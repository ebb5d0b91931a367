"""A long prompt encoded in pieces on several threads gives exactly the whole text's ids (special tokens too),
for the default tokenizer and Llama-3- and Qwen2-style pipelines; other tokenizers are encoded whole."""

from __future__ import annotations

import asyncio
import itertools
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, processors

from radixmesh.engine.hf_tokenizer import encode_text, load_tokenizer
from radixmesh.engine.split_encode import LLAMA3_PATTERN, QWEN2_PATTERN, SplitEncoder, can_split, cut_points
from radixmesh.engine.tokenize_pool import TokenizerPool

SAMPLES = ["The quick brown fox jumps over the lazy dog. ", "Numbers 1234567 and 3.14159, 2,000,000 items! ",
           "héllo wörld — naïve café 你好 🎉 ", "line one\n\nline two\ttab  double  spaces   three ",
           "<|im_start|>user\nspecial tokens as text<|im_end|> ", "don't can't I'll we've 'quoted' ",
           "(brackets) [more] {json: \"value\"} a+b=c; x->y ", "\u00a0no-break\u2009thin\u3000ideographic space ",
           "e\u0301 combining acute, A\u030a ring, \ufb01 ligature "]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def executor() -> Any:
    with ThreadPoolExecutor(3) as pool:
        yield pool


def prompts(tokenizer: Any, count: int, seed: int) -> list[str]:
    """Random-token text (with special tokens, as the `random` workload's and worse) and mixed natural text."""
    rng = random.Random(seed)
    vocab = list(range(len(tokenizer)))
    texts = []
    for i in range(count):
        if i % 2:
            texts.append(str(tokenizer.decode(rng.choices(vocab, k=rng.randint(20, 2500)))))
        else:
            texts.append("".join(rng.choice(SAMPLES) for _ in range(rng.randint(1, 120))))
    return texts


def rust_variant(tokenizer: Any, pre: Any, normalizer: Any = None) -> Any:
    """The default model's vocabulary and merges under another pipeline, with BOS and EOS added by a template."""
    backend = Tokenizer.from_str(tokenizer._tokenizer.to_str())
    backend.pre_tokenizer = pre
    if normalizer is not None:
        backend.normalizer = normalizer
    bos, eos = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A <|im_end|>", special_tokens=[("<|im_start|>", bos), ("<|im_end|>", eos)])
    return backend


def check_pieces_equal_whole(backend: Any, texts: list[str], executor: Any) -> None:
    encode = SplitEncoder(backend, executor, max_pieces=4, min_piece_chars=64)
    assert sum(bool(cut_points(t, 4, 64)) for t in texts) > len(texts) // 2, "too few texts were cut"
    for special in (True, False):
        whole = [e.ids for e in backend.encode_batch(texts, add_special_tokens=special)]
        assert encode(texts, special) == whole


def test_default_tokenizer_pieces_equal_the_whole(tokenizer: Any, executor: Any) -> None:
    assert can_split(tokenizer._tokenizer)
    texts = prompts(tokenizer, 160, seed=0)
    check_pieces_equal_whole(tokenizer._tokenizer, texts, executor)
    encode = SplitEncoder(tokenizer._tokenizer, executor, max_pieces=4, min_piece_chars=64)
    assert encode(texts[:20], True) == [encode_text(tokenizer, t) for t in texts[:20]]


@pytest.mark.parametrize("style", ["llama3", "qwen2"])
def test_llama3_and_qwen2_pipelines_pieces_equal_the_whole(tokenizer: Any, executor: Any, style: str) -> None:
    pattern, normalizer = (LLAMA3_PATTERN, None) if style == "llama3" else (QWEN2_PATTERN, normalizers.NFC())
    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), "isolated"),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend = rust_variant(tokenizer, pre, normalizer)
    assert can_split(backend)
    check_pieces_equal_whole(backend, prompts(tokenizer, 80, seed=1), executor)


def test_other_pipelines_are_encoded_whole(tokenizer: Any) -> None:
    metaspace = rust_variant(tokenizer, pre_tokenizers.Metaspace())
    other_regex = rust_variant(tokenizer, pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\S+\s?"), "isolated"), pre_tokenizers.ByteLevel(use_regex=False)]))
    prefix_space = rust_variant(tokenizer, pre_tokenizers.ByteLevel(add_prefix_space=True))
    lowercase = rust_variant(tokenizer, pre_tokenizers.ByteLevel(add_prefix_space=False))
    lowercase.normalizer = normalizers.Lowercase()
    assert can_split(rust_variant(tokenizer, pre_tokenizers.ByteLevel(add_prefix_space=False)))
    for backend in (metaspace, other_regex, prefix_space, lowercase):
        assert not can_split(backend)


def test_cuts_elsewhere_would_change_the_ids(tokenizer: Any, executor: Any, monkeypatch: Any) -> None:
    """A cut after a space instead of before it separates the space from its word: other ids, which the
    equality check above sees."""
    from radixmesh.engine import split_encode

    def after_the_space(text: str, max_pieces: int, min_piece_chars: int = 64) -> list[int]:
        return [c + 1 for c in cut_points(text, max_pieces, min_piece_chars)]

    monkeypatch.setattr(split_encode, "cut_points", after_the_space)
    with pytest.raises(AssertionError):
        check_pieces_equal_whole(tokenizer._tokenizer, prompts(tokenizer, 10, seed=3), executor)


def test_an_added_token_that_strips_spaces_disables_pieces(tokenizer: Any) -> None:
    from tokenizers import AddedToken

    backend = rust_variant(tokenizer, pre_tokenizers.ByteLevel(add_prefix_space=False))
    assert can_split(backend)
    backend.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert not can_split(backend)


def test_cut_points_sit_after_visible_characters_and_keep_pieces_long() -> None:
    text = "word, " * 2000 + "日本語" * 100 + " tail"
    cuts = cut_points(text, 4, 1000)
    assert len(cuts) == 3
    bounds = [0, *cuts, len(text)]
    assert all(b - a >= 1000 for a, b in itertools.pairwise(bounds))
    assert all(text[c] == " " and text[c - 1] == "," for c in cuts)
    assert cut_points("x" * 10_000, 4, 1000) == []  # no space to cut at
    assert cut_points("word " * 100, 4, 1000) == []  # too short for two pieces
    assert cut_points("a\u00a0 " * 5000, 4, 1000) == []  # only after whitespace-like characters


class CountingExecutor(ThreadPoolExecutor):
    """Counts the pieces submitted to it."""

    num_submitted = 0

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        self.num_submitted += 1
        return super().submit(*args, **kwargs)


def test_pieces_only_go_to_spare_threads(tokenizer: Any) -> None:
    text = prompts(tokenizer, 2, seed=4)[1] * 4
    with CountingExecutor(3) as executor:
        spare = [3]
        encode = SplitEncoder(tokenizer._tokenizer, executor, 4, min_piece_chars=64, spare_threads=lambda: spare[0])
        whole = encode_text(tokenizer, text)
        assert encode([text], True) == [whole] and executor.num_submitted == 3  # idle pool: four pieces
        spare[0] = 1
        assert encode([text], True) == [whole] and executor.num_submitted == 4  # one idle worker: two pieces
        spare[0] = 0
        assert encode([text], True) == [whole] and executor.num_submitted == 4  # every worker busy: whole


def test_the_pool_encodes_long_prompts_in_pieces_with_the_same_ids(tokenizer: Any) -> None:
    texts = [t * 8 for t in prompts(tokenizer, 6, seed=2)]

    async def run() -> list[list[int]]:
        pool = TokenizerPool(tokenizer, num_workers=4)
        try:
            assert isinstance(pool._encode, SplitEncoder)
            first = await pool.encode(texts[0])  # alone on an idle pool: in pieces
            assert pool._piece_executor is not None and len(pool._piece_executor._threads) >= 1
            rest = await asyncio.gather(*(pool.encode(t) for t in texts[1:]))
            return [first.ids, *(e.ids for e in rest)]
        finally:
            pool.close()

    assert asyncio.run(run()) == [encode_text(tokenizer, t) for t in texts]
    single = TokenizerPool(tokenizer, num_workers=1)
    assert not isinstance(single._encode, SplitEncoder)  # no other thread to give pieces to
    single.close()


def test_a_many_core_host_cuts_shorter_pieces_on_more_threads(tokenizer: Any, monkeypatch: Any) -> None:
    from radixmesh.engine import split_encode, tokenize_pool

    assert split_encode.default_min_piece_chars(2) == split_encode.MIN_PIECE_CHARS
    assert split_encode.default_min_piece_chars(16) == split_encode.MIN_PIECE_CHARS_MANY_CORES
    assert split_encode.MIN_PIECE_CHARS_MANY_CORES < split_encode.MIN_PIECE_CHARS
    text = (prompts(tokenizer, 2, seed=3)[1] * 8)[:12000]
    assert len(cut_points(text, 8, split_encode.MIN_PIECE_CHARS_MANY_CORES)) > len(
        cut_points(text, 8, split_encode.MIN_PIECE_CHARS))
    monkeypatch.setattr(tokenize_pool, "usable_cores", lambda: 16)
    with ThreadPoolExecutor(7) as pool:
        encode = tokenize_pool.batch_encoder(tokenizer, pool, max_pieces=8)
        assert isinstance(encode, SplitEncoder)
        assert encode.min_piece_chars == split_encode.MIN_PIECE_CHARS_MANY_CORES
        assert encode([text], True) == [encode_text(tokenizer, text)]


def test_the_shortest_piece_can_be_set_for_ab_runs(tokenizer: Any, monkeypatch: Any) -> None:
    from radixmesh.common.errors import RadixMeshError
    from radixmesh.engine import split_encode, tokenize_pool

    monkeypatch.setenv("RADIXMESH_TOKENIZE_MIN_PIECE_CHARS", "768")
    assert split_encode.default_min_piece_chars(2) == 768
    assert split_encode.default_min_piece_chars(16) == 768
    monkeypatch.setattr(tokenize_pool, "usable_cores", lambda: 16)
    with ThreadPoolExecutor(7) as pool:
        encode = tokenize_pool.batch_encoder(tokenizer, pool, max_pieces=8)
        assert isinstance(encode, SplitEncoder) and encode.min_piece_chars == 768
        text = (prompts(tokenizer, 2, seed=5)[1] * 8)[:12000]
        assert encode([text], True) == [encode_text(tokenizer, text)]
    for bad in ("12", "abc", "-5"):
        monkeypatch.setenv("RADIXMESH_TOKENIZE_MIN_PIECE_CHARS", bad)
        with pytest.raises(RadixMeshError, match="RADIXMESH_TOKENIZE_MIN_PIECE_CHARS"):
            split_encode.default_min_piece_chars(16)
    monkeypatch.delenv("RADIXMESH_TOKENIZE_MIN_PIECE_CHARS")
    assert split_encode.default_min_piece_chars(16) == split_encode.MIN_PIECE_CHARS_MANY_CORES
