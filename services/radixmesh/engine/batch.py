"""A scheduled batch: which requests run, which tokens they feed, where their KV goes."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixmesh.engine.attention.base import ForwardMode
from radixmesh.engine.kv_manager import KVCacheManager
from radixmesh.engine.request import Req

if TYPE_CHECKING:
    from radixmesh.engine.sampling.sampler import SampleOutput


@dataclass
class ScheduleBatch:
    """Host-side description of one pass; the model runner turns it into a ForwardBatch.

    DECODE: the runner also records each request's new slot in `req_to_token` (at row
    `req_pool_indices[i]`, column `positions[i]`) with the same host-to-device copy as the inputs.
    """

    mode: ForwardMode
    reqs: list[Req]
    input_ids: list[int]
    positions: list[int]
    out_cache_loc: torch.Tensor  # [num_tokens] int64 KV slots on the pool's device
    prefix_lens: list[int]
    extend_lens: list[int]
    req_pool_indices: list[int]
    """Row of each request in `req_to_token`."""
    future_rows: list[int] | None = None
    """DECODE under overlap: row of each input token in the previous launch's output, or -1."""
    prompt_logprobs: PromptLogprobPlan | None = None
    """EXTEND: which packed tokens' logits score owed prompt tokens (None when no request owes any)."""

    @functools.cached_property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE


@dataclass
class LaunchedBatch:
    """A batch whose forward and sampling are enqueued; its tokens are read back later."""

    launch_id: int
    batch: ScheduleBatch
    sampled: SampleOutput


@dataclass
class PromptLogprobPlan:
    """Prompt log-probs of one extend pass: the logits at packed row `rows[i]` score `targets[i]`."""

    rows: list[int]
    """Packed index of the token before each scored prompt token."""
    targets: list[int]
    """The scored prompt token ids."""
    counts: list[int]
    """Scored tokens per request, in batch order (rows are grouped the same way)."""
    next_pos: list[int]
    """Each request's `input_logprob_pos` once this pass ran."""


def plan_prompt_logprobs(reqs: list[Req]) -> PromptLogprobPlan | None:
    """Score every owed prompt token whose preceding position is among this pass's new tokens.

    Admission limits the cached prefix (`Req.max_prefix_len`) so that no owed token's
    preceding position is skipped; chunks each score their own stretch.
    """
    if not any(r.owes_input_logprobs for r in reqs):
        return None
    plan = PromptLogprobPlan([], [], [], [])
    offset = 0
    for req in reqs:
        start, end = req.kv_len, req.kv_len + req.extend_len
        first = max(req.input_logprob_pos, 1)  # the first prompt token has no log-prob
        last = min(len(req.origin_input_ids), end + 1)
        if req.owes_input_logprobs:
            assert start <= first - 1, f"request {req.rid}: prompt log-prob position {first} fell into the cache"
        scored = range(first, last) if req.owes_input_logprobs else range(0)
        plan.rows += [offset + pos - 1 - start for pos in scored]
        plan.targets += [req.origin_input_ids[pos] for pos in scored]
        plan.counts.append(len(scored))
        plan.next_pos.append(max(first, last) if req.owes_input_logprobs else req.input_logprob_pos)
        offset += req.extend_len
    return plan


def build_extend_batch(reqs: list[Req], kv: KVCacheManager) -> ScheduleBatch | None:
    """Rows and slots for each request's `extend_len` new tokens; None if memory ran out."""
    for req in reqs:
        if not kv.assign_row(req):
            return None
    slots = kv.alloc_for(reqs, [r.extend_len for r in reqs])
    if slots is None:
        return None
    input_ids: list[int] = []
    positions: list[int] = []
    offset = 0
    for req in reqs:
        start, end = req.kv_len, req.kv_len + req.extend_len
        input_ids.extend(req.all_ids[start:end])
        positions.extend(range(start, end))
        assert req.req_pool_idx is not None
        kv.req_pool.write(req.req_pool_idx, start, slots[offset:offset + req.extend_len])
        offset += req.extend_len
    return ScheduleBatch(ForwardMode.EXTEND, reqs, input_ids, positions, slots,
                         [r.kv_len for r in reqs], [r.extend_len for r in reqs], _pool_rows(reqs),
                         prompt_logprobs=plan_prompt_logprobs(reqs))


def build_decode_batch(reqs: list[Req], kv: KVCacheManager) -> ScheduleBatch | None:
    """One slot per request for its last sampled token; None if memory ran out.

    The slots reach `req_to_token` when the runner copies the batch's inputs (no copy here).
    """
    slots = kv.alloc_for(reqs, [1] * len(reqs))
    if slots is None:
        return None
    kv_lens = [r.kv_len for r in reqs]
    input_ids = [r.output_ids[-1] if not r.futures else 0 for r in reqs]
    future_rows = [r.futures[-1][1] if r.futures else -1 for r in reqs]
    return ScheduleBatch(ForwardMode.DECODE, reqs, input_ids, kv_lens, slots, kv_lens, [1] * len(reqs),
                         _pool_rows(reqs), future_rows if any(row >= 0 for row in future_rows) else None)


def _pool_rows(reqs: list[Req]) -> list[int]:
    rows = [r.req_pool_idx for r in reqs if r.req_pool_idx is not None]
    assert len(rows) == len(reqs), "a scheduled request has no req_to_token row"
    return rows


@dataclass(frozen=True)
class FutureIndex:
    """Where each input id of a batch comes from: row `index[i]` of `cat(previous tokens, host ids)`."""

    index: list[int]
    """A future's row in the previous launch's output, else `num_prev + i` (its own host id)."""
    all_future: bool
    """Every id is a future: the previous tokens alone are gathered."""
    identity: bool
    """The previous launch's tokens are this batch's ids as they are (same rows, same order)."""


def future_index(future_rows: list[int] | None, num_prev: int) -> FutureIndex | None:
    """The gather plan of `resolve_futures`; None when no input token is a future."""
    if future_rows is None:
        return None
    index = [row if row >= 0 else num_prev + i for i, row in enumerate(future_rows)]
    all_future = all(row >= 0 for row in future_rows)
    identity = all_future and num_prev == len(index) and index == list(range(num_prev))
    return FutureIndex(index, all_future, identity)


def resolve_futures(ids: torch.Tensor, plan: FutureIndex, index: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    """Overwrite the placeholder ids `[n]` in place with the tokens the previous launch sampled.

    Device work only (the sampled tokens never visit the host); `index` is `plan.index` on the device.
    """
    assert ids.shape[0] == len(plan.index) == index.shape[0], (
        f"{ids.shape[0]} ids, {len(plan.index)} planned, {index.shape[0]} indices")
    if plan.identity:
        ids.copy_(prev_tokens)
    elif plan.all_future:
        torch.index_select(prev_tokens, 0, index, out=ids)
    else:
        torch.index_select(torch.cat((prev_tokens, ids)), 0, index, out=ids)


def commit_batch(batch: ScheduleBatch) -> None:
    """The pass ran: its tokens now have KV, and its prompt log-probs are on their way."""
    for req in batch.reqs:
        req.kv_len += 1 if batch.is_decode else req.extend_len
    plan = batch.prompt_logprobs
    if plan is None:
        return
    for req, next_pos in zip(batch.reqs, plan.next_pos):
        if req.input_logprob_pos == 0:
            req.pending_input_logprobs.append(None)
            req.pending_input_top_logprobs.append(None)
        req.input_logprob_pos = next_pos
