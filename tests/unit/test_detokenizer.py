"""Incremental detokenization, stop-string hold-back and the scheduler's stop check.

Tokenizers are trained in memory on a tiny corpus (no network): a GPT-2 style byte-level
BPE, whose tokens split multi-byte UTF-8 characters, and a Llama style Metaspace BPE,
whose tokens lose their leading space when decoded alone.
"""

from __future__ import annotations

import functools
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from radixmesh.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher, find_stop_string

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, héllo wörld, ça va? naïve café",
    "stop here END of the text. The answer is 42.",
    "你好 世界 🙂",
]
SAMPLES = [
    "héllo 你好 🙂 wörld",
    "naïve café: 日本語のテキスト 🎉🚀 done",
    "The answer is 42. END of story, ça va?",
    "emoji chain 👩‍👩‍👧 and Ελληνικά and עברית",
]


@functools.cache
def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


@functools.cache
def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def decode(tok: PreTrainedTokenizerFast, ids: list[int], skip: bool = True) -> str:
    text = tok.decode(ids, skip_special_tokens=skip)
    assert isinstance(text, str)
    return text


def token_id(tok: PreTrainedTokenizerFast, token: str) -> int:
    found = tok.convert_tokens_to_ids(token)
    assert isinstance(found, int)
    return found


def stream(tokenizer: PreTrainedTokenizerFast, ids: list[int], chunk: int = 1,
           skip_special_tokens: bool = True, prompt_ids: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    pieces = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.flush())
    return pieces


def test_byte_level_tokens_really_split_characters() -> None:
    tok = byte_level_tokenizer()
    ids = tok.encode(SAMPLES[1])
    assert any("\ufffd" in decode(tok, [i]) for i in ids), "test data must split UTF-8 sequences"


@pytest.mark.parametrize("text", SAMPLES)
@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_stream_matches_full_decode_without_broken_characters(text: str, chunk: int) -> None:
    tok = byte_level_tokenizer()
    ids = tok.encode(text)
    pieces = stream(tok, ids, chunk)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(skip: bool) -> None:
    tok = byte_level_tokenizer()
    eos, pad = token_id(tok, "<|endoftext|>"), token_id(tok, "<|pad|>")
    ids = [*tok.encode("héllo"), pad, *tok.encode(" 你好"), eos]
    joined = "".join(stream(tok, ids, skip_special_tokens=skip))
    assert joined == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|endoftext|>" in joined) is not skip


def test_flush_releases_an_incomplete_character() -> None:
    tok = byte_level_tokenizer()
    ids = tok.encode("ok 🎉")
    cut = next(n for n in range(len(ids), 0, -1) if decode(tok, ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok)
    emitted = detok.add(ids[:cut])
    assert "\ufffd" not in emitted
    tail = detok.flush()
    assert emitted + tail == decode(tok, ids[:cut]) and tail.endswith("\ufffd")
    assert detok.flush() == ""


@pytest.mark.parametrize("chunk", [1, 4])
def test_metaspace_keeps_spaces_between_tokens(chunk: int) -> None:
    tok = metaspace_tokenizer()
    text = "the lazy fox says hello world"
    ids = tok.encode(text)
    assert "".join(decode(tok, [i]) for i in ids) != text, "per-token decode must lose spaces"
    assert "".join(stream(tok, ids, chunk)) == tok.decode(ids) == text


def test_prompt_context_keeps_first_leading_space() -> None:
    tok = metaspace_tokenizer()
    prompt = tok.encode("the quick brown")
    output = tok.encode("the quick brown fox jumps")[len(prompt):]
    assert "".join(stream(tok, output, prompt_ids=prompt)) == " fox jumps"


# --- StopStringMatcher ---------------------------------------------------------------------------

def test_matcher_holds_back_a_possible_stop_start() -> None:
    matcher = StopStringMatcher(("world",))
    assert matcher.feed("Hello wo") == ("Hello ", False)
    assert matcher.feed("rld and more") == ("", True)
    assert matcher.matched == "world"
    assert matcher.feed("ignored") == ("", True)


def test_matcher_releases_a_false_start() -> None:
    matcher = StopStringMatcher(("world",))
    assert matcher.feed("wo") == ("", False)
    assert matcher.feed("w") == ("wo", False)
    assert matcher.feed("!") == ("w!", False)
    assert matcher.feed("wor") == ("", False)
    assert matcher.flush() == "wor"
    assert matcher.flush() == ""


def test_matcher_cuts_at_the_earliest_stop() -> None:
    matcher = StopStringMatcher(("END", "\n\n", "stop"))
    assert matcher.feed("a stop\n\nEND") == ("a ", True)
    assert matcher.matched == "stop"


def test_matcher_random_splits_equal_one_shot_cut() -> None:
    rng = random.Random(0)
    stops = ("ab", "abc", "🙂!", "xyzzy")
    for _ in range(300):
        text = "".join(rng.choice("abcxyz🙂! ") for _ in range(rng.randint(0, 30)))
        cuts = [i for i in (text.find(s) for s in stops) if i != -1]
        expected = text[:min(cuts)] if cuts else text
        matcher = StopStringMatcher(stops)
        out, stopped, pos = "", False, 0
        while pos < len(text) and not stopped:
            step = rng.randint(1, 4)
            piece, stopped = matcher.feed(text[pos:pos + step])
            out += piece
            pos += step
        if not stopped:
            out += matcher.flush()
        assert (out, stopped) == (expected, bool(cuts)), text


# --- find_stop_string ----------------------------------------------------------------------------

def fire_steps(tok: PreTrainedTokenizerFast, ids: list[int], stop: tuple[str, ...],
               skip: bool = True) -> list[tuple[int, str]]:
    return [(n, hit) for n in range(1, len(ids) + 1)
            if (hit := find_stop_string(tok, ids[:n], stop, skip)) is not None]


def completing_steps(tok: PreTrainedTokenizerFast, ids: list[int], stop: str) -> list[int]:
    """Reference: the prefixes whose full decode holds one more occurrence than the previous one."""
    counts = [decode(tok, ids[:n]).count(stop) for n in range(len(ids) + 1)]
    return [n for n in range(1, len(ids) + 1) if counts[n] > counts[n - 1]]


@pytest.mark.parametrize("stop", ["END", "42.", "你好", "🙂", "é", " the"])
def test_stop_fires_once_on_the_completing_token(stop: str) -> None:
    tok = byte_level_tokenizer()
    text = "The answer is 42. END of story, 你好 🙂 héllo; the END again 你好🙂 and the rest"
    ids = tok.encode(text)
    expected = completing_steps(tok, ids, stop)
    assert len(expected) >= 1
    assert fire_steps(tok, ids, (stop,)) == [(n, stop) for n in expected]


def test_stop_spanning_zero_char_tokens() -> None:
    tok = byte_level_tokenizer()
    pad = token_id(tok, "<|pad|>")
    ids = tok.encode("xx E") + [pad] * 12 + tok.encode("N") + [pad] * 12 + tok.encode("D yy")
    fired = fire_steps(tok, ids, ("END",))
    assert [hit for _, hit in fired] == ["END"]
    assert fired[0][0] == completing_steps(tok, ids, "END")[0]
    assert fire_steps(tok, ids, ("END",), skip=False) == []


def test_stop_reports_the_earliest_of_several() -> None:
    tok = metaspace_tokenizer()
    ids = tok.encode("the lazy dog")
    assert find_stop_string(tok, ids, ("dog", "lazy dog")) == "lazy dog"
    assert find_stop_string(tok, ids, ("cat",)) is None
    assert find_stop_string(tok, [], ("dog",)) is None
