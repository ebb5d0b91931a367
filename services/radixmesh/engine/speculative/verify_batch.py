"""The verify pass's batch: each request's last sampled token followed by its drafts, as one EXTEND.

A request with `k` drafts feeds `k + 1` tokens at positions `kv_len .. kv_len + k` and reserves
as many KV slots. After verification `settle` keeps the slots of the accepted prefix (the last
token and the accepted drafts; the token sampled after them has no KV yet, as after any decode
step) and frees the rest. A draft tree (tree.py) feeds its nodes at `kv_len + depth` into the slots
`kv_len .. kv_len + k` in node order; `settle_tree_kv` then writes the accepted path's slots into the
request's row in path order (page size 1: a slot list needs no KV copy) and frees the other nodes'.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixmesh.engine.attention.base import ForwardMode
from radixmesh.engine.batch import ScheduleBatch
from radixmesh.engine.device_io import to_device
from radixmesh.engine.kv_manager import KVCacheManager
from radixmesh.engine.request import Req
from radixmesh.engine.speculative.base import Proposal
from radixmesh.engine.speculative.tree import depths, is_chain


@dataclass
class VerifyBatch(ScheduleBatch):
    """A decode step whose requests verify drafts (some may have none: one token, as in decode)."""

    drafts: list[list[int]] = field(default_factory=list)
    """Per request, the draft tokens fed after its last token."""
    proposal: Proposal | None = None
    """Where the drafts came from (their distributions for rejection sampling)."""
    device_drafts: torch.Tensor | None = None
    """[drafts] int64 on the device, the drafts' values at packed rows `draft_rows` (the input ids there hold
    placeholders) when they never went to the host."""
    draft_rows: list[int] = field(default_factory=list)
    trees: list[list[int]] | None = None
    """Per request, each fed row's parent row (-1: the root, its last token) when some request verifies a draft
    tree (tree.py); None: every request verifies a chain (the causal mask)."""

    def put_device_drafts(self, ids: torch.Tensor, rows: list[int] | None = None) -> None:
        """Write the device drafts into `ids` (at `rows`, default the packed rows: a graph's layout may differ)."""
        if self.device_drafts is not None and self.device_drafts.shape[0]:
            index = to_device(self.draft_rows if rows is None else rows, torch.int64, ids.device)
            ids.index_copy_(0, index, self.device_drafts)

    @property
    def row_starts(self) -> list[int]:
        """First packed row (= token) of each request."""
        starts, offset = [], 0
        for n in self.extend_lens:
            starts.append(offset)
            offset += n
        return starts

    @property
    def num_rows(self) -> int:
        return sum(self.extend_lens)


def build_verify_batch(reqs: list[Req], proposal: Proposal, kv: KVCacheManager) -> VerifyBatch | None:
    """Rows and KV slots for each request's last token and drafts; None if memory ran out."""
    drafts = proposal.drafts
    assert len(drafts) == len(reqs), f"{len(drafts)} draft lists for {len(reqs)} requests"
    lens = [len(d) + 1 for d in drafts]
    trees = _row_parents(proposal)
    slots = kv.alloc_slots(sum(lens))
    if slots is None:
        return None
    input_ids: list[int] = []
    positions: list[int] = []
    offset = 0
    for i, (req, tokens, n) in enumerate(zip(reqs, drafts, lens)):
        assert req.req_pool_idx is not None and not req.futures, f"request {req.rid} is not ready to verify"
        start = req.kv_len
        assert start == req.fill_len - 1, f"request {req.rid}: {start} tokens with KV, {req.fill_len} tokens"
        input_ids += [req.output_ids[-1], *tokens]
        positions += range(start, start + n) if trees is None else [start + d for d in depths(trees[i])]
        kv.req_pool.req_to_token[req.req_pool_idx, start:start + n] = slots[offset:offset + n]
        offset += n
    pool_rows = [r.req_pool_idx for r in reqs if r.req_pool_idx is not None]
    batch = VerifyBatch(ForwardMode.EXTEND, reqs, input_ids, positions, slots, [r.kv_len for r in reqs], lens,
                        pool_rows, drafts=[list(d) for d in drafts], proposal=proposal, trees=trees)
    if proposal.device_drafts is not None:  # (drafts may have been shortened: their first rows stay)
        index: list[int] = []
        for tokens, first, start in zip(drafts, proposal.prob_rows, batch.row_starts):
            index += range(first, first + len(tokens))
            batch.draft_rows += range(start + 1, start + 1 + len(tokens))
        batch.device_drafts = proposal.device_drafts.index_select(
            0, to_device(index, torch.int64, proposal.device_drafts.device))
    return batch


def _row_parents(proposal: Proposal) -> list[list[int]] | None:
    """Each request's row parents (root first) when some request's drafts form a tree (not a chain), else None."""
    if proposal.parents is None:
        return None
    trees = []
    for drafts, parents in zip(proposal.drafts, proposal.parents):
        assert len(parents) >= len(drafts), f"{len(parents)} parents for {len(drafts)} drafts"
        trees.append([-1, *(p + 1 for p in parents[:len(drafts)])])
    return None if all(is_chain(t) for t in trees) else trees


def settle_tree_kv(req: Req, start: int, num_reserved: int, path: list[int], kv: KVCacheManager) -> int:
    """After a tree's verification: the slots of the accepted path's rows `path` (offsets from `start`, the root's
    0 first; fewer when a stop cut the request's tokens short) become positions `start ..` of the request's row,
    in path order; the other reserved slots are freed. Returns the new `kv_len`."""
    assert req.req_pool_idx is not None, f"request {req.rid} lost its row before its drafts settled"
    keep = min(len(path), len(req.all_ids) - start)
    assert keep >= 1 and path[0] == 0, f"request {req.rid}: the verified token itself has no KV"
    row = kv.req_pool.req_to_token[req.req_pool_idx]
    reserved = row[start:start + num_reserved].clone()
    index = to_device(path[:keep], torch.int64, reserved.device)
    rejected = torch.ones(num_reserved, dtype=torch.bool, device=reserved.device)
    rejected[index] = False
    kv.allocator.free(reserved[rejected])
    kv.req_pool.write(req.req_pool_idx, start, reserved.index_select(0, index))
    req.kv_len = start + keep
    return req.kv_len


def settle_kv(req: Req, start: int, num_reserved: int, num_accepted: int, kv: KVCacheManager) -> int:
    """Keep the KV of the verified token and the accepted drafts (fewer when a stop cut the request's
    tokens short), free the other slots reserved from `start`. Returns the new `kv_len`.

    Position `start + i` was fed draft `i` (the last sampled token for i = 0): its KV is valid while
    the request's tokens still hold that draft, i.e. for `i <= num_accepted`.
    """
    assert req.req_pool_idx is not None, f"request {req.rid} lost its row before its drafts settled"
    end = start + num_reserved
    valid = min(start + num_accepted + 1, len(req.all_ids), end)
    assert valid >= start + 1, f"request {req.rid}: the verified token itself has no KV ({valid} <= {start})"
    if valid < end:
        row = kv.req_pool.req_to_token[req.req_pool_idx]
        kv.allocator.free(row[valid:end].clone())
    req.kv_len = valid
    return valid
