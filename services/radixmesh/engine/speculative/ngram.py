"""N-gram drafts: continue the request's latest suffix the way it continued last time it occurred.

Prompt-lookup decoding: rewriting, extending or editing a given text repeats long stretches of
the prompt (and of the output), so the tokens that followed the previous occurrence of the last
few tokens are likely to follow again. No second model, no device work: a dict lookup per request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixmesh.engine.speculative.base import BaseProposer, Proposal, ProposerContext

if TYPE_CHECKING:
    from radixmesh.engine.request import Req


class NgramIndex:
    """For each n in [min_n, max_n]: the latest end position of every n-gram of a growing token list.

    `tables[n][gram] = e` means `tokens[e - n:e] == gram`; only ends before the list's last position
    are indexed, so a lookup of the current suffix finds an earlier occurrence, never itself.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n, f"need 1 <= min_n <= max_n, got {min_n}, {max_n}"
        self.min_n, self.max_n = min_n, max_n
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed_end = 0
        """Ends up to this position are indexed."""

    def lookup(self, tokens: list[int], num_drafts: int) -> list[int]:
        """Up to `num_drafts` tokens continuing `tokens` as its longest recurring suffix continued before."""
        self._index(tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            gram = tuple(tokens[length - n:])
            end = self.tables[n].get(gram)
            if end is None or tuple(tokens[end - n:end]) != gram:  # a stale entry (the list was edited)
                continue
            return _continuation(tokens, end, num_drafts)
        return []

    def _index(self, tokens: list[int]) -> None:
        last_end = len(tokens) - 1  # the suffix ends at len(tokens): it must not find itself
        for end in range(max(self.indexed_end + 1, self.min_n), last_end + 1):
            for n, table in self.tables.items():
                if end >= n:
                    table[tuple(tokens[end - n:end])] = end
        self.indexed_end = max(self.indexed_end, last_end)


def _continuation(tokens: list[int], end: int, num_drafts: int) -> list[int]:
    """The tokens after position `end`, read on periodically past the list's end (a suffix that
    recurs `len(tokens) - end` tokens back predicts a repeat with that period)."""
    length = len(tokens)
    out: list[int] = []
    for j in range(num_drafts):
        pos = end + j
        out.append(tokens[pos] if pos < length else out[pos - length])
    return out


class NgramProposer(BaseProposer):
    """Drafts from `NgramIndex` over each request's prompt and output; deterministic (point masses)."""

    id = "ngram"
    relative_cost = 0.0

    def __init__(self, ctx: ProposerContext) -> None:
        self.min_n = ctx.config.speculative_ngram_min_match
        self.max_n = ctx.config.speculative_ngram_max_match
        self.indexes: dict[str, NgramIndex] = {}
        self.num_lookups = 0
        self.num_hits = 0

    def propose(self, reqs: list[Req], max_drafts: list[int]) -> Proposal:
        drafts: list[list[int]] = []
        for req, limit in zip(reqs, max_drafts):
            if limit <= 0:
                drafts.append([])
                continue
            index = self.indexes.get(req.rid)
            if index is None:
                index = self.indexes[req.rid] = NgramIndex(self.min_n, self.max_n)
            found = index.lookup(req.all_ids, limit)
            self.num_lookups += 1
            self.num_hits += bool(found)
            drafts.append(found)
        return Proposal(drafts)

    def release(self, req: Req) -> None:
        self.indexes.pop(req.rid, None)

    def stats(self) -> dict[str, float | int]:
        return {"spec_ngram_lookups": self.num_lookups, "spec_ngram_hits": self.num_hits}
