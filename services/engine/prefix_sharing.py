"""In-batch prefix sharing: requests that arrive together with a common prefix compute it once.

Waiting requests are matched against the radix cache, but a prefix that several of them
share and that nobody has computed yet matches nothing there: admitted together, each
would prefill it. Instead, the first of them (in policy order) is admitted and the others
wait one step; its prompt KV enters the cache when its prefill is launched, so they match
it at the next step.
"""

from __future__ import annotations

from radixmesh.engine.radix_cache import common_prefix_len
from radixmesh.engine.request import Req


class _Edge:
    __slots__ = ("children", "key")

    def __init__(self, key: list[int]) -> None:
        self.key = key
        self.children: dict[int, _Edge] = {}


class TokenTrie:
    """Radix trie of token sequences (no KV): the longest prefix of a key that any inserted sequence shares."""

    def __init__(self) -> None:
        self.root = _Edge([])

    def longest_shared(self, key: list[int]) -> int:
        node, i = self.root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                return i
            matched = common_prefix_len(child.key, key, i)
            i += matched
            if matched < len(child.key):
                return i
            node = child
        return i

    def insert(self, key: list[int]) -> None:
        node, i = self.root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                node.children[key[i]] = _Edge(key[i:])
                return
            matched = common_prefix_len(child.key, key, i)
            if matched < len(child.key):
                upper = _Edge(child.key[:matched])
                child.key = child.key[matched:]
                upper.children[child.key[0]] = child
                node.children[key[i]] = upper
                child = upper
            node, i = child, i + matched


def defer_shared_prefixes(ordered: list[Req], threshold: int,
                          computing: Req | None = None) -> tuple[list[Req], list[Req]]:
    """Split policy-ordered waiting requests into (candidates, deferred).

    Every request must have been matched against the cache in this step. A request is
    deferred when at least `threshold` tokens beyond its cached prefix are shared with a
    candidate before it, or with `computing` (a prompt being prefilled in chunks): that
    one computes them, and the deferred request reuses them at a later step. A request
    waits only while such a sharer is ahead of it, so it is admissible at the latest
    once its sharers' prefills have been launched.
    """
    if threshold <= 0 or len(ordered) + (computing is not None) < 2:
        return list(ordered), []
    trie = TokenTrie()
    if computing is not None:
        trie.insert(computing.all_ids)
    candidates: list[Req] = []
    deferred: list[Req] = []
    for req in ordered:
        shared = trie.longest_shared(req.all_ids[: req.max_prefix_len])
        if shared - len(req.prefix_indices) >= threshold:
            deferred.append(req)
        else:
            candidates.append(req)
            trie.insert(req.all_ids)
    return candidates, deferred
