"""Draft trees in a verify pass: their layout, attention mask and greedy acceptance.

A request verifying a tree feeds its last sampled token (the root, row 0) and its draft nodes (rows 1..n), each
node after its parent, at position `kv_len + depth`. `parents[r]` is row r's parent row (-1 for the root). A node's
token is accepted when it is the target's argmax at its parent's row and its parent was accepted: the accepted
nodes form one root-to-node path (siblings hold distinct tokens), the longest that agrees with plain decoding,
and the argmax at the path's last row is the token after it. Chains are the trees whose parents are `r - 1`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixmesh.engine.attention.base import TreeMask
from radixmesh.engine.device_io import rows_to_device


def depths(parents: list[int]) -> list[int]:
    """Each row's depth (the root's 0); parents come before their children."""
    out: list[int] = []
    for r, p in enumerate(parents):
        assert (p == -1) == (r == 0) and p < r, f"row {r}'s parent {p}: the root comes first, parents before children"
        out.append(0 if p < 0 else out[p] + 1)
    return out


def is_chain(parents: list[int]) -> bool:
    return all(p == r - 1 for r, p in enumerate(parents))


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: row t sees row j iff j is t or one of its ancestors."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for r in range(1, n):
        mask[r] |= mask[parents[r]]
    return mask


def build_tree_mask(trees: list[list[int]], device: torch.device) -> TreeMask:
    """The verify pass's mask of requests with these row parents (chains get their causal triangle)."""
    masks = [ancestor_mask(parents) for parents in trees]
    indptr = [0]
    for m in masks:
        indptr.append(indptr[-1] + m.numel())
    flat = torch.cat([m.reshape(-1) for m in masks])
    return TreeMask(flat.to(device, non_blocking=True), torch.tensor(indptr, dtype=torch.int64).to(device), masks)


@dataclass
class TreeRows:
    """Device tensors describing a tree verify pass's rows (all `[rows]` int64), request by request."""

    parent: torch.Tensor
    """Packed row of each row's parent; a root's is itself."""
    depth: torch.Tensor
    segment: torch.Tensor
    """The request (batch row) of each row."""
    root: torch.Tensor
    """[num_reqs] each request's root row."""
    max_depth: int
    num_rows: int


def tree_rows(trees: list[list[int]], device: torch.device) -> TreeRows:
    parent: list[int] = []
    depth: list[int] = []
    segment: list[int] = []
    root: list[int] = []
    for i, parents in enumerate(trees):
        start = len(parent)
        root.append(start)
        parent += [start + (p if p >= 0 else 0) for p in parents]
        depth += depths(parents)
        segment += [i] * len(parents)
    parent_t, depth_t, segment_t, root_t = rows_to_device([parent, depth, segment, root], device)
    return TreeRows(parent_t, depth_t, segment_t, root_t, max(depth, default=0), len(parent))


def tree_accept(tokens: torch.Tensor, final: torch.Tensor, rows: TreeRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance along the trees: `tokens` `[rows]` the fed tokens, `final` `[rows]` the target's token at
    each row. Returns (`[num_reqs]` accepted drafts, `[rows]` emit rows): request i's row `root + d` emits
    `final[emit[root + d]]` for d <= accepted (the path's rows from the root); later rows point at themselves."""
    is_root = rows.depth == 0
    agrees = ~is_root & (tokens == final.index_select(0, rows.parent))
    on_path = is_root.clone()
    for _ in range(rows.max_depth):  # a node is on the path when it agrees and its parent is on it
        on_path = is_root | (agrees & on_path.index_select(0, rows.parent))
    num_reqs = rows.root.shape[0]
    index = torch.arange(rows.num_rows, device=tokens.device)
    # one path node per depth: the deepest one's (depth, row) is the largest key
    key = torch.where(on_path, rows.depth * rows.num_rows + index, torch.full_like(index, -1))
    best = torch.full((num_reqs,), -1, dtype=torch.int64, device=tokens.device)
    best = best.scatter_reduce(0, rows.segment, key, reduce="amax", include_self=True)
    num_accepted = best // rows.num_rows
    emit = index.clone()
    cur = best % rows.num_rows
    for d in range(rows.max_depth, -1, -1):  # walk each path back from its last node to the root
        live = num_accepted >= d
        target = torch.where(live, rows.root + d, rows.root)
        value = torch.where(live, cur, emit.index_select(0, rows.root))
        emit.scatter_(0, target, value)
        cur = torch.where(live, rows.parent.index_select(0, cur), cur)
    return num_accepted, emit
