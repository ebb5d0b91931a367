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
    """Split policy-ordered waiting requests into (candidates, deferred), both in policy order.

    Every request must have been matched against the cache in this step. A request is
    deferred when at least `threshold` tokens beyond its cached prefix are shared with a
    candidate before it, or with `computing` (a prompt being prefilled in chunks): that
    one computes them, and the deferred request reuses them at a later step. A request
    waits only while such a sharer is ahead of it, so it is admissible at the latest
    once its sharers' prefills have been launched.

    Two requests can only share that much if their first `threshold` tokens agree, so
    requests are first bucketed by those; with nothing shared, no trie is built at all.
    """
    if threshold <= 0 or len(ordered) + (computing is not None) < 2:
        return list(ordered), []
    groups: dict[tuple[int, ...], list[Req]] = {}
    for req in ordered:
        ids = _ids(req)
        if len(ids) >= threshold:
            groups.setdefault(tuple(ids[:threshold]), []).append(req)
    head = tuple(_ids(computing)[:threshold]) if computing is not None else None
    deferred: set[int] = set()
    for key, group in groups.items():
        sharer = computing if key == head else None
        if len(group) > 1 or sharer is not None:
            deferred.update(id(req) for req in _defer_in_group(group, threshold, sharer))
    if not deferred:
        return list(ordered), []
    return ([r for r in ordered if id(r) not in deferred], [r for r in ordered if id(r) in deferred])


def _defer_in_group(group: list[Req], threshold: int, computing: Req | None) -> list[Req]:
    trie = TokenTrie()
    if computing is not None:
        trie.insert(_ids(computing))
    deferred: list[Req] = []
    for req in group:
        ids = _ids(req)
        shared = trie.longest_shared(ids[: req.max_prefix_len])
        if shared - len(req.prefix_indices) >= threshold:
            deferred.append(req)
        else:
            trie.insert(ids)
    return deferred


def _ids(req: Req) -> list[int]:
    """Tokens whose KV the request needs (`all_ids`, without building a new list when nothing was generated)."""
    return req.all_ids if req.output_ids else req.origin_input_ids
