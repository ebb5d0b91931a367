"""One rank's share of a batch under data-parallel attention, and the shape of the pass over all ranks.

Rank 0 schedules one batch over every rank's requests (each request carries its rank, `Req.dp_rank`) and
broadcasts it whole; each rank cuts out its own requests here, in batch order, with their tokens, KV slots,
future-token rows and prompt log-prob rows renumbered within the share. Plain host arithmetic, the same on every
rank, so that every rank agrees on every rank's counts (`DpPass`) without a collective.
"""

from __future__ import annotations

import bisect

import torch

from radixmesh.engine.batch import PromptLogprobPlan, ScheduleBatch
from radixmesh.engine.distributed.dp_attention import DpPass


def split_batch(batch: ScheduleBatch, num_ranks: int, rank: int) -> tuple[ScheduleBatch, DpPass]:
    """Rank `rank`'s share of `batch` and the pass's shape over `num_ranks` ranks."""
    ranks = [req.dp_rank for req in batch.reqs]
    assert all(0 <= r < num_ranks for r in ranks), f"requests' data-parallel ranks {ranks} outside {num_ranks}"
    starts = [0]
    for n in batch.extend_lens:
        starts.append(starts[-1] + n)
    members = [[i for i, r in enumerate(ranks) if r == rank_] for rank_ in range(num_ranks)]
    extra = _extra_rows_by_request(batch, starts)
    num_tokens = tuple(sum(batch.extend_lens[i] for i in m) for m in members)
    num_rows = tuple(len(m) + sum(len(extra[i]) for i in m) for m in members)
    return _share(batch, members[rank], starts, extra), DpPass(num_tokens, num_rows,
                                                               _row_order(members, extra, num_rows, len(ranks)))


def _extra_rows_by_request(batch: ScheduleBatch, starts: list[int]) -> list[list[int]]:
    """Each request's prompt log-prob rows (packed indices of the whole batch, increasing), placed by the request
    whose tokens hold them (a follower's plan carries the rows alone)."""
    plan = batch.prompt_logprobs
    rows: list[list[int]] = [[] for _ in batch.reqs]
    for row in plan.rows if plan is not None else []:
        rows[bisect.bisect_right(starts, row) - 1].append(row)
    return rows


def _share(batch: ScheduleBatch, mine: list[int], starts: list[int], extra: list[list[int]]) -> ScheduleBatch:
    tokens = [t for i in mine for t in range(starts[i], starts[i] + batch.extend_lens[i])]
    local_extra: list[int] = []
    offset = 0
    for i in mine:
        local_extra += [row - starts[i] + offset for row in extra[i]]
        offset += batch.extend_lens[i]
    futures = batch.future_rows
    future_rows = [futures[i] for i in mine] if futures is not None else None
    index = torch.tensor(tokens, dtype=torch.int64).to(batch.out_cache_loc.device, non_blocking=True)
    return ScheduleBatch(
        batch.mode, [batch.reqs[i] for i in mine], [batch.input_ids[t] for t in tokens],
        [batch.positions[t] for t in tokens], batch.out_cache_loc.index_select(0, index),
        [batch.prefix_lens[i] for i in mine], [batch.extend_lens[i] for i in mine],
        [batch.req_pool_indices[i] for i in mine],
        future_rows if future_rows is not None and any(r >= 0 for r in future_rows) else None,
        PromptLogprobPlan(local_extra, [], [], []) if local_extra else None)


def _row_order(members: list[list[int]], extra: list[list[int]], num_rows: tuple[int, ...],
               num_reqs: int) -> tuple[int, ...]:
    """Where each logit row of the whole batch sits among the ranks' rows laid one after the other."""
    last = [0] * num_reqs
    extra_at: list[list[int]] = [[] for _ in range(num_reqs)]
    base = 0
    for rank, mine in enumerate(members):
        after = base + len(mine)  # this rank's prompt log-prob rows follow its requests' last rows
        for k, i in enumerate(mine):
            last[i] = base + k
            extra_at[i] = list(range(after, after + len(extra[i])))
            after += len(extra[i])
        base += num_rows[rank]
    return tuple(last + [row for rows in extra_at for row in rows])
