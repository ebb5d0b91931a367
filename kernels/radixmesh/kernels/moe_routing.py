"""MoE routing on the device: the router's top-k, and the assignments sorted by expert in aligned blocks.

A token's `top_k` assignments (token m, slot k; flat index `m * top_k + k`) are grouped by expert and each
expert's group padded to a multiple of `block_m` rows, so that every block of the grouped GEMMs
(`moe_gemm`) holds one expert's rows: `sorted_ids` lists the assignments block by block, `block_expert`
names each block's expert (-1 for the unused tail) and `block_rows` how many of its rows are real.
Within an expert, assignments keep token order.

No host sync anywhere: the number of blocks is bounded from host ints (`max_blocks`: each expert with
tokens wastes at most `block_m - 1` rows) and the GEMMs' programs past the used blocks exit at once, so
a decode step can be captured in a CUDA graph. Up to `route_rows(E)` tokens (decode batches) one program
routes and places everything in one launch; larger batches take two: one program per row block routes
and counts its rows' experts per expert, then each places its rows after the counts of the blocks
before it and writes its share of the block table.

Top-k: scores are the softmax or sigmoid of the logits (optionally plus a selection bias), chosen
highest first with ties to the lower expert index (the reference `moe_ref.route_ref` breaks ties the
same way), renormalized over the chosen ones when the model says so, times the routed scaling factor.

Expert parallelism: only experts `expert_start .. expert_start + num_local - 1` are placed (the ones on
this rank); assignments to the others are left out of the blocks and add nothing when combined.

Expert load: with an `expert_load` counter (`[E]` int64) the routing programs also add each expert's
assignments of the batch to it (atomics, in the same launch), so a model keeps per-expert totals across
steps and layers without a launch of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import check_device, check_float, check_last_dim_contiguous, next_power_of_2
from radixmesh.kernels._jit import unspecialized
from radixmesh.kernels._pdl import gdc_launch_dependents, gdc_wait, pdl_args
from radixmesh.kernels.moe_ref import SCORINGS

MAX_EXPERTS = 1024
"""Most experts a router row may have (one program holds a row of scores)."""
ROUTE_CELLS = 4096
"""Scores one routing program holds (rows x experts, padded to powers of two)."""
BLOCK_B = 64
"""Block-table entries written per step of the placing loop."""


@dataclass(frozen=True)
class RouterSpec:
    """How a model's router turns logits into experts and weights (the fields of its config)."""

    top_k: int
    """Experts per token (`num_experts_per_tok`)."""
    scoring: str = "softmax"
    """`softmax` (Mixtral, Qwen3-MoE) or `sigmoid` (DeepSeek-V3) of the logits."""
    renormalize: bool = True
    """Divide the chosen experts' scores by their sum (`norm_topk_prob`; Mixtral always does)."""
    routed_scaling_factor: float = 1.0
    """Multiplies the weights after renormalization (DeepSeek-V3: 2.5)."""

    def __post_init__(self) -> None:
        assert self.top_k >= 1, f"top_k must be >= 1, got {self.top_k}"
        assert self.scoring in SCORINGS, f"scoring must be one of {SCORINGS}, got {self.scoring!r}"
        assert math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0, (
            f"routed_scaling_factor must be finite and > 0, got {self.routed_scaling_factor}")


@dataclass(frozen=True)
class MoeAlignment:
    """A batch's assignments grouped by expert in blocks of `block_m` rows (views of `RoutingBuffers`)."""

    topk_ids: torch.Tensor  # [M, top_k] int32, global expert ids
    topk_weights: torch.Tensor  # [M, top_k] float32
    sorted_ids: torch.Tensor  # [num_blocks * block_m] int32: m * top_k + k, block by block (padding undefined)
    block_expert: torch.Tensor  # [num_blocks] int32: local expert of each block, -1 past the used ones
    block_rows: torch.Tensor  # [num_blocks] int32: real rows of each block (the rest is padding)
    block_m: int
    expert_start: int
    num_local: int

    @property
    def num_blocks(self) -> int:
        return int(self.block_expert.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.topk_ids.shape[1])


def max_blocks(num_assign: int, num_local: int, block_m: int) -> int:
    """Blocks the placement of `num_assign` assignments over `num_local` experts can need at most."""
    return triton.cdiv(num_assign + min(num_local, num_assign) * (block_m - 1), block_m)


def route_rows(num_experts: int) -> int:
    """Tokens one routing program handles: the whole batch up to this many (one launch)."""
    return max(1, min(64, ROUTE_CELLS // next_power_of_2(num_experts)))


@dataclass(frozen=True)
class RoutingBuffers:
    """Outputs of `route_align` for batches of up to `max_tokens` tokens, allocated once (CUDA graphs reuse them)."""

    topk_ids: torch.Tensor  # [max_tokens, top_k] int32
    topk_weights: torch.Tensor  # [max_tokens, top_k] float32
    counts: torch.Tensor  # [row blocks, E] int32: each row block's assignments per expert
    sorted_ids: torch.Tensor  # [most placed rows of any block_m up to max_block_m] int32
    block_expert: torch.Tensor  # [max_blocks] int32
    block_rows: torch.Tensor  # [max_blocks] int32
    max_block_m: int

    @classmethod
    def allocate(cls, max_tokens: int, top_k: int, num_experts: int, num_local: int, max_block_m: int,
                 device: torch.device) -> RoutingBuffers:
        sizes = [1 << i for i in range(max_block_m.bit_length())]  # every block_m up to max_block_m
        nb = max(max_blocks(max_tokens * top_k, num_local, bm) for bm in sizes)
        rows = max(max_blocks(max_tokens * top_k, num_local, bm) * bm for bm in sizes)

        def ints(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=torch.int32, device=device)

        return cls(ints(max_tokens, top_k), torch.empty(max_tokens, top_k, dtype=torch.float32, device=device),
                   ints(triton.cdiv(max_tokens, route_rows(num_experts)), num_experts), ints(rows),
                   ints(nb), ints(nb), max_block_m)


@triton.jit
def _route_rows(logits_ptr, bias_ptr, ids_ptr, weights_ptr, rows, cols, M, E, stride, scaling,
                TOP_K: tl.constexpr, BLOCK_TK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                SIGMOID: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Top-k of rows `rows`: stores ids and weights, returns the slot `[BLOCK_M, BLOCK_E]` each chosen expert
    fills in its row (-1 where not chosen)."""
    row_ok = rows < M
    col_ok = cols < E
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        x = tl.where(col_ok[None, :], x, float("-inf"))
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        scores = p / tl.sum(p, axis=1)[:, None]
    select = scores
    if HAS_BIAS:
        select += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    select = tl.where(col_ok[None, :], select, float("-inf"))
    kcol = tl.arange(0, BLOCK_TK)
    ids = tl.zeros((BLOCK_M, BLOCK_TK), dtype=tl.int32)
    weights = tl.zeros((BLOCK_M, BLOCK_TK), dtype=tl.float32)
    slot = tl.full((BLOCK_M, BLOCK_E), -1, dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.argmax(select, axis=1, tie_break_left=True).to(tl.int32)  # [BLOCK_M]
        hit = cols[None, :] == best[:, None]
        ids = tl.where(kcol[None, :] == i, best[:, None], ids)
        weights = tl.where(kcol[None, :] == i, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], weights)
        slot = tl.where(hit, i, slot)
        select = tl.where(hit, float("-inf"), select)
    if RENORM:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    weights = weights * scaling
    mask = row_ok[:, None] & (kcol[None, :] < TOP_K)
    offs = rows[:, None] * TOP_K + kcol[None, :]
    tl.store(ids_ptr + offs, ids, mask=mask)
    tl.store(weights_ptr + offs, weights, mask=mask)
    return slot


@triton.jit
def _slots_from_ids(ids_ptr, rows, cols, M, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """The slot matrix of `_route_rows` rebuilt from stored ids."""
    slot = tl.full((BLOCK_M, BLOCK_E), -1, dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        idk = tl.load(ids_ptr + rows * TOP_K + k, mask=rows < M, other=-1)
        slot = tl.where(cols[None, :] == idk[:, None], k, slot)
    return slot


@triton.jit
def _local_choices(slot, rows, cols, M, expert_start, num_local):
    """1 where a row chose a column's expert and that expert is on this rank, else 0 (`[BLOCK_M, BLOCK_E]`)."""
    local = cols - expert_start
    ok = (slot >= 0) & (rows[:, None] < M) & (local[None, :] >= 0) & (local[None, :] < num_local)
    return ok.to(tl.int32)


@triton.jit
def _place(chosen, slot, total, before, rows, cols, sorted_ptr, block_expert_ptr, block_rows_ptr, expert_start,
           first_block, end_block, TOP_K: tl.constexpr, ALIGN_M: tl.constexpr, BLOCK_B: tl.constexpr):
    """Writes the sorted positions of these rows' assignments and the block table entries [first, end).

    `total` `[BLOCK_E]`: the batch's assignments per expert; `before`: those of earlier row blocks."""
    padded = (total + ALIGN_M - 1) // ALIGN_M * ALIGN_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    rank = tl.cumsum(chosen, axis=0) - chosen + before[None, :]
    tl.store(sorted_ptr + start[None, :] + rank, rows[:, None] * TOP_K + slot, mask=chosen > 0)
    block_end = end // ALIGN_M  # [BLOCK_E] blocks up to and including each expert's
    used = tl.sum(padded, axis=0) // ALIGN_M
    fill = start + total  # end of each expert's real rows
    for b0 in range(first_block, end_block, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        e = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), axis=1)  # the column whose blocks hold b
        fill_b = tl.sum(tl.where(cols[None, :] == e[:, None], fill[None, :], 0), axis=1)
        nrows = tl.minimum(tl.maximum(fill_b - b * ALIGN_M, 0), ALIGN_M)
        live = b < used
        tl.store(block_expert_ptr + b, tl.where(live, e - expert_start, -1), mask=b < end_block)
        tl.store(block_rows_ptr + b, tl.where(live, nrows, 0), mask=b < end_block)


@triton.jit(**unspecialized(ints=("M",)))
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, counts_ptr, sorted_ptr, block_expert_ptr,
                  block_rows_ptr, load_ptr, M, E, stride, scaling, expert_start, num_local, num_blocks,
                  TOP_K: tl.constexpr, BLOCK_TK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                  ROUTE: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                  FUSED: tl.constexpr, ALIGN_M: tl.constexpr, BLOCK_B: tl.constexpr, COUNT_LOAD: tl.constexpr,
                  PDL: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    if PDL:
        gdc_wait()
    if ROUTE:
        slot = _route_rows(logits_ptr, bias_ptr, ids_ptr, weights_ptr, rows, cols, M, E, stride, scaling,
                           TOP_K, BLOCK_TK, BLOCK_M, BLOCK_E, SIGMOID, RENORM, HAS_BIAS)
    else:
        slot = _slots_from_ids(ids_ptr, rows, cols, M, TOP_K, BLOCK_M, BLOCK_E)
    chosen = _local_choices(slot, rows, cols, M, expert_start, num_local)
    counts = tl.sum(chosen, axis=0)
    if COUNT_LOAD:  # every expert's assignments in these rows, local or not
        picked = ((slot >= 0) & (rows[:, None] < M)).to(tl.int64)
        tl.atomic_add(load_ptr + cols, tl.sum(picked, axis=0), mask=cols < E)
    if PDL:
        gdc_launch_dependents()
    if FUSED:  # the whole batch in this program: place it now
        _place(chosen, slot, counts, counts * 0, rows, cols, sorted_ptr, block_expert_ptr, block_rows_ptr,
               expert_start, 0, num_blocks, TOP_K, ALIGN_M, BLOCK_B)
    else:
        tl.store(counts_ptr + pid * E + cols, counts, mask=cols < E)


@triton.jit(**unspecialized(ints=("M", "num_row_blocks")))
def _align_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, M, E, expert_start, num_local,
                  num_row_blocks, num_blocks, blocks_per_program, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_E: tl.constexpr, ALIGN_M: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    if PDL:
        gdc_wait()
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    before = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for r0 in range(0, num_row_blocks, BLOCK_M):  # every row block's counts: totals, and the sums before this one
        r = r0 + tl.arange(0, BLOCK_M)
        c = tl.load(counts_ptr + r[:, None] * E + cols[None, :],
                    mask=(r[:, None] < num_row_blocks) & (cols[None, :] < E), other=0)
        total += tl.sum(c, axis=0)
        before += tl.sum(tl.where(r[:, None] < pid, c, 0), axis=0)
    slot = _slots_from_ids(ids_ptr, rows, cols, M, TOP_K, BLOCK_M, BLOCK_E)
    chosen = _local_choices(slot, rows, cols, M, expert_start, num_local)
    if PDL:
        gdc_launch_dependents()
    first = pid * blocks_per_program
    _place(chosen, slot, total, before, rows, cols, sorted_ptr, block_expert_ptr, block_rows_ptr, expert_start,
           first, tl.minimum(first + blocks_per_program, num_blocks), TOP_K, ALIGN_M, BLOCK_B)


def _check_buffers(buffers: RoutingBuffers, m: int, top_k: int, num_experts: int, nb: int, block_m: int,
                   device: torch.device) -> None:
    for name in ("topk_ids", "topk_weights", "counts", "sorted_ids", "block_expert", "block_rows"):
        check_device(f"buffers.{name}", getattr(buffers, name), device)
    assert buffers.topk_ids.shape[0] >= m and buffers.topk_ids.shape[1] == top_k, (
        f"buffers hold {tuple(buffers.topk_ids.shape)} top-k ids, the batch needs [{m}, {top_k}]")
    assert buffers.counts.shape[1] == num_experts, f"buffers count {buffers.counts.shape[1]} experts, not {num_experts}"
    assert buffers.counts.shape[0] >= triton.cdiv(m, route_rows(num_experts)), "buffers.counts has too few rows"
    assert buffers.block_expert.shape[0] >= nb and buffers.sorted_ids.shape[0] >= nb * block_m, (
        f"buffers hold {buffers.block_expert.shape[0]} blocks / {buffers.sorted_ids.shape[0]} rows, the batch "
        f"may need {nb} / {nb * block_m} (allocate with a larger max_tokens or max_block_m)")


def route_align(logits: torch.Tensor | None, spec: RouterSpec, block_m: int, buffers: RoutingBuffers | None = None,
                *, num_experts: int | None = None, correction_bias: torch.Tensor | None = None,
                expert_start: int = 0, num_local: int | None = None,
                topk_ids: torch.Tensor | None = None, expert_load: torch.Tensor | None = None) -> MoeAlignment:
    """Routes `logits` `[M, E]` (float) and places the assignments of experts `expert_start ..
    expert_start + num_local - 1` in blocks of `block_m` rows.

    With `topk_ids` `[M, top_k]` (int32, distinct per row; ids outside the local experts are left out) the
    routing is given: `logits` is then None, `num_experts` names E and the weights are not written.
    `correction_bias` `[E]` is added to the scores for selection only. `expert_load` `[E]` (int64) gets each
    expert's assignments of the batch added (all E, not only the local ones). One launch for batches of up to
    `route_rows(E)` tokens, two above.
    """
    if topk_ids is None:
        assert logits is not None, "give the router logits, or topk_ids"
        assert logits.dim() == 2, f"logits must be [M, E], got {tuple(logits.shape)}"
        check_float("logits", logits)
        check_last_dim_contiguous("logits", logits)
        m, num_experts = logits.shape
        device = logits.device
    else:
        assert topk_ids.dim() == 2 and topk_ids.dtype == torch.int32 and topk_ids.is_contiguous(), (
            f"topk_ids must be a contiguous int32 [M, top_k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
        assert topk_ids.shape[1] == spec.top_k, f"topk_ids has {topk_ids.shape[1]} columns, top_k is {spec.top_k}"
        assert num_experts is not None, "with topk_ids, give num_experts"
        m, device = topk_ids.shape[0], topk_ids.device
    num_local = num_experts - expert_start if num_local is None else num_local
    assert 1 <= num_experts <= MAX_EXPERTS, f"{num_experts} experts: the router handles 1..{MAX_EXPERTS}"
    assert spec.top_k <= num_experts, f"top_k {spec.top_k} exceeds the {num_experts} experts"
    assert expert_start >= 0 and num_local >= 1 and expert_start + num_local <= num_experts, (
        f"local experts [{expert_start}, {expert_start + num_local}) outside the {num_experts} experts")
    assert block_m >= 1 and block_m & (block_m - 1) == 0 and block_m <= 256, f"block_m {block_m}: a power of 2 <= 256"
    if correction_bias is not None:
        check_device("correction_bias", correction_bias, device)
        assert tuple(correction_bias.shape) == (num_experts,) and correction_bias.is_contiguous(), (
            f"correction_bias must be a contiguous [{num_experts}], got {tuple(correction_bias.shape)}")
    if expert_load is not None:
        check_device("expert_load", expert_load, device)
        assert expert_load.dtype == torch.int64 and tuple(expert_load.shape) == (num_experts,) and \
            expert_load.is_contiguous(), f"expert_load must be a contiguous int64 [{num_experts}]"
    nb = max_blocks(m * spec.top_k, num_local, block_m)
    if buffers is None:
        buffers = RoutingBuffers.allocate(m, spec.top_k, num_experts, num_local, block_m, device)
    _check_buffers(buffers, m, spec.top_k, num_experts, nb, block_m, device)
    result = MoeAlignment(topk_ids if topk_ids is not None else buffers.topk_ids[:m], buffers.topk_weights[:m],
                          buffers.sorted_ids[:nb * block_m], buffers.block_expert[:nb], buffers.block_rows[:nb],
                          block_m, expert_start, num_local)
    if m == 0:
        result.block_expert.fill_(-1)
        return result
    rows_per_program = route_rows(num_experts)
    grid = triton.cdiv(m, rows_per_program)
    common = {"BLOCK_M": rows_per_program, "BLOCK_E": next_power_of_2(num_experts), "TOP_K": spec.top_k,
              "ALIGN_M": block_m, "BLOCK_B": BLOCK_B, **pdl_args(device)}
    ids = result.topk_ids
    _route_kernel[(grid,)](
        logits if logits is not None else ids, correction_bias if correction_bias is not None else ids, ids,
        result.topk_weights, buffers.counts, result.sorted_ids, result.block_expert, result.block_rows,
        expert_load if expert_load is not None else buffers.counts, m, num_experts,
        logits.stride(0) if logits is not None else 0, spec.routed_scaling_factor, expert_start, num_local, nb,
        BLOCK_TK=next_power_of_2(spec.top_k), ROUTE=topk_ids is None, SIGMOID=spec.scoring == "sigmoid",
        RENORM=spec.renormalize, HAS_BIAS=correction_bias is not None, FUSED=grid == 1,
        COUNT_LOAD=expert_load is not None, **common)
    if grid > 1:
        _align_kernel[(grid,)](
            ids, buffers.counts, result.sorted_ids, result.block_expert, result.block_rows, m, num_experts,
            expert_start, num_local, grid, nb, triton.cdiv(nb, grid), **common)
    return result
