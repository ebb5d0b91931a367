"""In-batch prefix sharing on its own: which waiting requests wait a step for a sharer, and the token trie it uses."""

from __future__ import annotations

import random

import pytest
import torch

from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.prefix_sharing import TokenTrie, defer_shared_prefixes
from radixmesh.wire.sampling import SamplingParams

T = 4  # threshold: tokens a request must share beyond its cached prefix to wait
BASE = list(range(100, 110))  # a 10-token prefix nobody has computed yet


def prompt(rid: str, ids: list[int], cached: int = 0, output: list[int] | None = None) -> Req:
    """A waiting request whose first `cached` tokens the cache holds (as a match would leave it)."""
    r = Req(rid=rid, origin_input_ids=ids, params=SamplingParams(max_new_tokens=8, temperature=0.0))
    r.output_ids = list(output or [])
    r.prefix_indices = torch.arange(cached, dtype=torch.int64)
    return r


def rids(reqs: list[Req]) -> list[str]:
    return [r.rid for r in reqs]


def test_the_first_sharer_runs_and_the_others_wait_in_policy_order() -> None:
    reqs = [prompt("a", [*BASE, 1]), prompt("x", [1, 2, 3, 4, 5]), prompt("b", [*BASE, 2]), prompt("c", [*BASE, 3])]
    candidates, deferred = defer_shared_prefixes(reqs, T)
    assert rids(candidates) == ["a", "x"] and rids(deferred) == ["b", "c"]


def test_the_shared_part_is_counted_beyond_the_cached_prefix() -> None:
    # b shares 10 tokens with a, but 8 of them are cached already: only 2 would be computed twice.
    reqs = [prompt("a", [*BASE, 1]), prompt("b", [*BASE, 2], cached=8)]
    assert rids(defer_shared_prefixes(reqs, T)[1]) == []
    # With 6 cached, 4 tokens are still shared (= threshold): b waits.
    reqs = [prompt("a", [*BASE, 1]), prompt("b", [*BASE, 2], cached=6)]
    assert rids(defer_shared_prefixes(reqs, T)[1]) == ["b"]


def test_a_prefix_shorter_than_the_threshold_is_computed_twice() -> None:
    reqs = [prompt("a", [1, 2, 3, 50, 51]), prompt("b", [1, 2, 3, 60, 61])]
    candidates, deferred = defer_shared_prefixes(reqs, T)
    assert rids(candidates) == ["a", "b"] and deferred == []


def test_a_prompt_shorter_than_the_threshold_never_waits() -> None:
    reqs = [prompt("a", BASE), prompt("b", BASE[:3])]
    assert defer_shared_prefixes(reqs, T) == (reqs, [])


def test_only_the_reusable_part_of_a_prompt_counts() -> None:
    """A request computes at least its last token, so a copy of a sharer's prompt shares one token less."""
    a = prompt("a", BASE[:5])
    b = prompt("b", BASE[:5])  # max_prefix_len 4: shares 4 tokens (= T) with a
    assert rids(defer_shared_prefixes([a, b], T)[1]) == ["b"]
    c = prompt("c", BASE[:4])  # max_prefix_len 3: shares only 3
    assert rids(defer_shared_prefixes([prompt("a", BASE[:5]), c], T)[1]) == []


def test_a_prompt_being_chunked_holds_back_every_sharer() -> None:
    computing = prompt("long", [*BASE, *range(200, 230)])
    reqs = [prompt("a", [*BASE, 1]), prompt("b", [*BASE, 2]), prompt("x", [7, 7, 7, 7, 7])]
    candidates, deferred = defer_shared_prefixes(reqs, T, computing)
    assert rids(candidates) == ["x"] and rids(deferred) == ["a", "b"]
    # A single waiting request counts too when a chunked prompt is its sharer.
    assert rids(defer_shared_prefixes([prompt("a", [*BASE, 1])], T, computing)[1]) == ["a"]


def test_generated_tokens_are_part_of_what_a_request_shares() -> None:
    """A retracted request needs its prompt and its output again: both count."""
    a = prompt("a", BASE[:3], output=BASE[3:8])
    b = prompt("b", [*BASE[:8], 9])
    assert rids(defer_shared_prefixes([a, b], T)[1]) == ["b"]


def test_a_threshold_of_zero_turns_sharing_off_and_one_request_alone_never_waits() -> None:
    reqs = [prompt("a", [*BASE, 1]), prompt("b", [*BASE, 2])]
    assert defer_shared_prefixes(reqs, 0) == (reqs, [])
    assert defer_shared_prefixes(reqs[:1], T) == (reqs[:1], [])
    assert defer_shared_prefixes([], T) == ([], [])


def test_the_result_is_new_lists_in_the_given_order() -> None:
    reqs = [prompt(f"r{i}", [i, i, i, i, i]) for i in range(5)]
    candidates, deferred = defer_shared_prefixes(reqs, T)
    assert candidates == reqs and candidates is not reqs and deferred == []


@pytest.mark.parametrize("seed", range(4))
def test_deferral_matches_a_brute_force_over_pairs(seed: int) -> None:
    """Each request waits exactly when some earlier candidate (or the chunked prompt) shares >= T uncached tokens."""
    rng = random.Random(seed)
    stems = [[rng.randrange(1, 6) for _ in range(12)] for _ in range(3)]
    reqs = []
    for i in range(20):
        stem = rng.choice(stems)
        ids = stem[: rng.randint(0, 12)] + [rng.randrange(1, 6) for _ in range(rng.randint(1, 6))]
        reqs.append(prompt(f"r{i}", ids, cached=rng.randint(0, min(3, len(ids) - 1))))
    computing = prompt("chunked", [*rng.choice(stems), 9]) if seed % 2 else None
    candidates, deferred = defer_shared_prefixes(reqs, T, computing)

    def shared(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    expected_candidates: list[Req] = []
    expected_deferred: list[Req] = []
    sharers = [computing.origin_input_ids] if computing is not None else []
    for r in reqs:
        reusable = r.origin_input_ids[: r.max_prefix_len]
        best = max((shared(reusable, s) for s in sharers), default=0)
        if best - len(r.prefix_indices) >= T:
            expected_deferred.append(r)
        else:
            expected_candidates.append(r)
            sharers.append(r.origin_input_ids)
    assert rids(candidates) == rids(expected_candidates)
    assert rids(deferred) == rids(expected_deferred)


@pytest.mark.parametrize("seed", range(4))
def test_the_trie_finds_the_longest_shared_prefix_of_any_inserted_key(seed: int) -> None:
    rng = random.Random(seed)
    trie = TokenTrie()
    keys: list[list[int]] = []
    for _ in range(30):
        key = [rng.randrange(3) for _ in range(rng.randint(1, 10))]
        trie.insert(key)  # splits edges where keys part
        keys.append(key)
        probe = [rng.randrange(3) for _ in range(rng.randint(0, 12))]
        brute = max(next((i for i, (x, y) in enumerate(zip(k, probe, strict=False)) if x != y),
                         min(len(k), len(probe))) for k in keys)
        assert trie.longest_shared(probe) == brute, (keys, probe)


def test_inserting_a_key_twice_or_a_prefix_of_one_changes_nothing() -> None:
    trie = TokenTrie()
    trie.insert([1, 2, 3, 4])
    trie.insert([1, 2, 3, 4])
    trie.insert([1, 2])
    assert trie.longest_shared([1, 2, 3, 4, 5]) == 4 and trie.longest_shared([1, 2, 7]) == 2
    assert list(trie.root.children) == [1] and trie.root.children[1].key == [1, 2]
