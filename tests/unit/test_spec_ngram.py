"""The n-gram lookup behind `--speculative-algorithm ngram`."""

from __future__ import annotations

import random

from radixmesh.engine.speculative.ngram import NgramIndex


def _reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Brute force: the longest recurring suffix, its latest earlier occurrence, read on periodically."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        gram = tokens[length - n:]
        ends = [e for e in range(n, length) if tokens[e - n:e] == gram]
        if ends:
            end, out = ends[-1], []
            for j in range(k):
                out.append(tokens[end + j] if end + j < length else out[end + j - length])
            return out
    return []


def test_copies_what_followed_the_last_occurrence() -> None:
    index = NgramIndex(2, 4)
    text = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert index.lookup(text, 3) == [8, 9, 1]  # "5 6 7" occurred before, followed by 8 9 1
    assert index.lookup([*text, 8], 2) == [9, 1]  # grown by one token: the index is extended, not rebuilt


def test_longest_match_wins_and_short_suffixes_do_not_match() -> None:
    index = NgramIndex(2, 3)
    # "3 4" recurs twice; the 3-gram "2 3 4" only once, followed by 50
    assert index.lookup([2, 3, 4, 50, 9, 3, 4, 60, 2, 3, 4], 1) == [50]
    assert NgramIndex(2, 3).lookup([1, 2, 3, 9, 3], 2) == []  # a lone "3" is below min_n


def test_periodic_text_predicts_the_repeat() -> None:
    # the suffix "1 2" last ended 2 tokens back: period 2, so drafts continue 1 2 1 2 past the end
    assert NgramIndex(2, 4).lookup([7, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert NgramIndex(1, 2).lookup([4, 4, 4], 3) == [4, 4, 4]


def test_no_match_in_fresh_text() -> None:
    assert NgramIndex(1, 4).lookup([1, 2, 3, 4, 5], 4) == []
    assert NgramIndex(1, 4).lookup([1], 4) == []


def test_edited_tokens_are_not_matched_stale() -> None:
    index = NgramIndex(2, 2)
    tokens = [1, 2, 3, 1, 2]
    assert index.lookup(tokens, 1) == [3]
    tokens[2] = 9  # an edit before the indexed end (as if a forced token replaced it)
    assert index.lookup(tokens, 1) == [9]  # read from the current list, not the stale one


def test_matches_brute_force_while_growing() -> None:
    rng = random.Random(7)
    for trial in range(40):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        index = NgramIndex(min_n, max_n)
        tokens = [rng.randrange(4) for _ in range(3)]
        for _ in range(60):
            k = rng.randint(1, 6)
            assert index.lookup(tokens, k) == _reference(tokens, k, min_n, max_n), (trial, tokens)
            tokens.append(rng.randrange(4))
