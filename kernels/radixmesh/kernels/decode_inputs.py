"""Staging a decode step's device inputs in one launch.

Before a decode graph replays, three things happen on the device: input ids that are
"futures" (tokens the previous launch sampled, never seen by the host) are gathered from
that launch's output, each request's new KV slot (from the device free list) is copied into
the graph's static slot buffer (padding rows get the dummy slot 0), and the slot is recorded
in `req_to_token` at the request's position. As separate PyTorch ops that is 3-5 small
launches per step, each costing more than its work; here it is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import check_device, check_index, check_last_dim_contiguous, next_power_of_2
from radixmesh.kernels._jit import unspecialized


@triton.jit(**unspecialized(  # row counts and slot-list slices differ from step to step
    ints=("num_rows", "num_padded", "num_prev"),
    pointers=("input_ids_ptr", "gather_ptr", "prev_ptr", "slots_src_ptr", "pool_rows_ptr", "positions_ptr")))
def _stage_decode_kernel(
    input_ids_ptr, gather_ptr, prev_ptr, slots_src_ptr, slots_dst_ptr, req_to_token_ptr, pool_rows_ptr,
    positions_ptr,
    num_rows, num_padded, num_prev, stride_r2t_row,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    live = offs < num_rows
    # a branch at run time, not a compile-time variant: a step whose inputs are all on the host (nothing was in
    # flight) runs the variant the warm-up's steps compiled (a variant of its own, compiled on first use while
    # serving, is the likely cause of 54-68 ms decode launches once seen on an H200 host)
    if num_prev > 0:
        # gather index < num_prev: the previous launch's token of that row; else the row keeps its id
        gather = tl.load(gather_ptr + offs, mask=live, other=num_prev)
        is_future = live & (gather < num_prev)
        token = tl.load(prev_ptr + gather, mask=is_future, other=0)
        tl.store(input_ids_ptr + offs, token.to(input_ids_ptr.dtype.element_ty), mask=is_future)
    slots = tl.load(slots_src_ptr + offs, mask=live, other=0)
    tl.store(slots_dst_ptr + offs, slots.to(slots_dst_ptr.dtype.element_ty), mask=offs < num_padded)
    rows = tl.load(pool_rows_ptr + offs, mask=live, other=0).to(tl.int64)
    positions = tl.load(positions_ptr + offs, mask=live, other=0).to(tl.int64)
    tl.store(req_to_token_ptr + rows * stride_r2t_row + positions, slots.to(req_to_token_ptr.dtype.element_ty),
             mask=live)


def stage_decode_inputs(input_ids: torch.Tensor, gather: torch.Tensor | None, prev_tokens: torch.Tensor | None,
                        slots_src: torch.Tensor, slots_dst: torch.Tensor, req_to_token: torch.Tensor,
                        pool_rows: torch.Tensor, positions: torch.Tensor) -> None:
    """For the first `n = slots_src.numel()` rows of a decode batch padded to `slots_dst.numel()`:

    - where `gather[i] < len(prev_tokens)`: `input_ids[i] = prev_tokens[gather[i]]` (skipped when
      `gather` is None: no input is a future);
    - `slots_dst[i] = slots_src[i]`, and 0 (the dummy slot) on padding rows `n <= i < padded`;
    - `req_to_token[pool_rows[i], positions[i]] = slots_src[i]`.

    `input_ids`, `gather`, `pool_rows`, `positions` hold at least n rows; all on one device.
    """
    device = slots_dst.device
    named = {"input_ids": input_ids, "slots_src": slots_src, "slots_dst": slots_dst, "pool_rows": pool_rows,
             "positions": positions}
    if gather is not None:
        assert prev_tokens is not None, "a gather index without the previous launch's tokens"
        named |= {"gather": gather, "prev_tokens": prev_tokens}
    for name, t in named.items():
        check_device(name, t, device)
        check_index(name, t)
    check_device("req_to_token", req_to_token, device)
    assert req_to_token.dim() == 2, f"req_to_token must be [rows, max_context], got {tuple(req_to_token.shape)}"
    assert req_to_token.dtype in (torch.int32, torch.int64), f"req_to_token has dtype {req_to_token.dtype}"
    check_last_dim_contiguous("req_to_token", req_to_token)
    num_rows, num_padded = slots_src.shape[0], slots_dst.shape[0]
    assert num_rows <= num_padded, f"{num_rows} rows for {num_padded} padded slots"
    for name in ("input_ids", "pool_rows", "positions", *(("gather",) if gather is not None else ())):
        assert named[name].shape[0] >= num_rows, f"{name} has {named[name].shape[0]} rows, need {num_rows}"
    if num_padded == 0:
        return
    num_prev = prev_tokens.shape[0] if gather is not None and prev_tokens is not None else 0
    _stage_decode_kernel[(1,)](
        input_ids, gather if gather is not None else input_ids,
        prev_tokens if gather is not None and prev_tokens is not None else input_ids,
        slots_src, slots_dst, req_to_token, pool_rows, positions,
        num_rows, num_padded, num_prev, req_to_token.stride(0),
        BLOCK=next_power_of_2(num_padded),
    )
