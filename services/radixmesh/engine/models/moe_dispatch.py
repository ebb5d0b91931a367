"""Expert parallelism by all-to-all: each token goes only to the ranks holding its experts, and comes back.

Every rank holds the batch's tokens (attention is tensor-parallel). Rank r takes its share of them (rows
`[r * share, (r + 1) * share)`), routes that share, and sends each (token, expert) assignment to the rank holding
the expert; the ranks run their experts on what they received, send the weighted outputs back, each rank sums its
tokens' outputs, and one all-gather gives every rank the whole batch again. Split sizes come from one all-gather
of every rank's per-expert counts (which also feed the expert-load counter), so each pass syncs with the host once:
eager passes only (`MoeRuntime.use_all_to_all`); CUDA graphs keep the all-reduce path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixmesh.engine.models.moe import SparseMoeBlock


def all_to_all_moe(block: SparseMoeBlock, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The layer's output `[tokens, hidden]` for all of `x`, on every rank (see the module docstring)."""
    lay = block.layout
    num_tokens, size = x.shape[0], lay.ep_size
    share = -(-num_tokens // size)
    begin, end = min(lay.ep_rank * share, num_tokens), min((lay.ep_rank + 1) * share, num_tokens)
    mine = torch.zeros(share, x.shape[1], dtype=x.dtype, device=x.device)
    mine[:end - begin] = exchange(block, x[begin:end], logits[begin:end])
    whole = block.tp.all_gather(mine)  # [ranks, share, hidden]
    return whole.reshape(size * share, x.shape[1])[:num_tokens]


def exchange(block: SparseMoeBlock, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The layer's output `[n, hidden]` for this rank's tokens `x` `[n, hidden]` (router `logits` `[n, E]`): each
    (token, expert) assignment to the expert's rank and back. Every rank calls it, with its own tokens (maybe none).
    Data-parallel attention calls it on each rank's own requests' tokens directly."""
    from radixmesh.kernels.moe_ref import route_ref

    tp, lay = block.tp, block.layout
    size = lay.ep_size
    weights, ids = route_ref(logits, block.router.top_k, renormalize=block.router.renormalize)
    flat_ids = ids.reshape(-1).long()  # [mine * top_k], assignment i is token i // top_k
    owner = flat_ids // lay.num_local  # the rank holding each assignment's expert
    order = torch.sort(owner, stable=True).indices  # assignments grouped by destination rank
    counts = torch.zeros(lay.num_experts, dtype=torch.int64, device=x.device)
    counts.index_add_(0, flat_ids, torch.ones_like(flat_ids))
    all_counts = tp.all_gather(counts)  # [ranks, E]: every rank's assignments per expert
    block.runtime.add_counts(all_counts.sum(0))
    per_rank = all_counts.view(size, size, lay.num_local).sum(-1).tolist()  # [from rank][to rank] (host sync)
    send, recv = per_rank[lay.ep_rank], [row[lay.ep_rank] for row in per_rank]
    token = order // block.router.top_k  # [sent] the token of each sent assignment
    recv_x = tp.all_to_all(x[token], send, recv)  # [received, hidden]
    recv_ids = tp.all_to_all(flat_ids[order].to(torch.int32), send, recv)
    recv_w = tp.all_to_all(weights.reshape(-1)[order].float(), send, recv)
    y = _run_received(block, recv_x, recv_ids, recv_w)  # [received, hidden], weighted
    back = tp.all_to_all(y, recv, send)  # [sent, hidden] in the order sent
    mine = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    mine.index_add_(0, token, back.float())
    return mine.to(x.dtype)


def _run_received(block: SparseMoeBlock, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each received row through its one (local) expert, times its router weight."""
    if x.shape[0] == 0:
        return x
    ids, weights = ids.view(-1, 1), weights.view(-1, 1)
    if not block.runtime.kernels_for(x):
        return block.expert_outputs(x, weights, ids)
    return _fused_received(block, x, ids, weights)


def _fused_received(block: SparseMoeBlock, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The Triton path of `_run_received`: the rows placed by their given experts, the two grouped GEMMs, the weight."""
    from radixmesh.kernels.fp8_quant import quantize_rows
    from radixmesh.kernels.moe import W8A16_MAX_TOKENS
    from radixmesh.kernels.moe_config import default_config, dtype_key
    from radixmesh.kernels.moe_gemm import moe_down, moe_gate_up
    from radixmesh.kernels.moe_routing import RouterSpec, route_align

    ex, lay = block.experts, block.layout
    m = x.shape[0]
    a8 = ex.is_fp8 and m > W8A16_MAX_TOKENS
    cfg = default_config(lay.num_local, lay.inter_local, x.shape[1], dtype_key(x.dtype, ex.is_fp8, a8), m, 1, x.device)
    al = route_align(None, RouterSpec(1), cfg.block_m, num_experts=lay.num_experts, topk_ids=ids.contiguous(),
                     expert_start=lay.expert_start, num_local=lay.num_local)
    # zeros: padding rows are never read back, but W8A8 quantizes them (finite values)
    inter = torch.zeros(al.num_blocks * al.block_m, lay.inter_local, dtype=x.dtype, device=x.device)
    y = torch.empty(m, x.shape[1], dtype=x.dtype, device=x.device)
    if a8:
        xq, xs = quantize_rows(x, ex.w13.dtype)
        moe_gate_up(xq, al, ex.w13, cfg.up, inter, x_scale=xs, w13_scale=ex.w13_scale)
        iq, i_s = quantize_rows(inter, ex.w2.dtype)
        moe_down(iq, al, ex.w2, cfg.down, y, inter_scale=i_s, w2_scale=ex.w2_scale)
    else:
        moe_gate_up(x, al, ex.w13, cfg.up, inter, w13_scale=ex.w13_scale)
        moe_down(inter, al, ex.w2, cfg.down, y, w2_scale=ex.w2_scale)
    return (y.float() * weights).to(x.dtype)
