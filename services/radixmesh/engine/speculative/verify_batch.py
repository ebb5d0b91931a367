"""The verify pass's batch: each request's last sampled token followed by its drafts, as one EXTEND.

A request with `k` drafts feeds `k + 1` tokens at positions `kv_len .. kv_len + k` and reserves
as many KV slots. After verification `settle` keeps the slots of the accepted prefix (the last
token and the accepted drafts; the token sampled after them has no KV yet, as after any decode
step) and frees the rest.
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
    slots = kv.alloc_slots(sum(lens))
    if slots is None:
        return None
    input_ids: list[int] = []
    positions: list[int] = []
    offset = 0
    for req, tokens, n in zip(reqs, drafts, lens):
        assert req.req_pool_idx is not None and not req.futures, f"request {req.rid} is not ready to verify"
        start = req.kv_len
        assert start == req.fill_len - 1, f"request {req.rid}: {start} tokens with KV, {req.fill_len} tokens"
        input_ids += [req.output_ids[-1], *tokens]
        positions += range(start, start + n)
        kv.req_pool.req_to_token[req.req_pool_idx, start:start + n] = slots[offset:offset + n]
        offset += n
    pool_rows = [r.req_pool_idx for r in reqs if r.req_pool_idx is not None]
    batch = VerifyBatch(ForwardMode.EXTEND, reqs, input_ids, positions, slots, [r.kv_len for r in reqs], lens,
                        pool_rows, drafts=[list(d) for d in drafts], proposal=proposal)
    if proposal.device_drafts is not None:  # (drafts may have been shortened: their first rows stay)
        index: list[int] = []
        for tokens, first, start in zip(drafts, proposal.prob_rows, batch.row_starts):
            index += range(first, first + len(tokens))
            batch.draft_rows += range(start + 1, start + 1 + len(tokens))
        batch.device_drafts = proposal.device_drafts.index_select(
            0, to_device(index, torch.int64, proposal.device_drafts.device))
    return batch


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
