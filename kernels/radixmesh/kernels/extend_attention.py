"""Extend attention: each request's new tokens attend to its cached prefix and, causally, to themselves.

Where K/V come from: the prefix from the KV pool through the request's slot list
(`kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`, prefix then new tokens). The new tokens' K/V come
from the same list (so they must be stored, `store_kv`, before this runs) or, given `k_new` /
`v_new` (the pass's own K/V rows, in the pool's dtype), from those rows directly: the same values,
read as contiguous rows instead of gathered slots. Either way attention sees exactly what the pool
holds, as the PyTorch reference does.

Grid (batch, kv_heads, query blocks), the blocks taken from the last (heaviest under the causal mask) to the
first. GQA: a program owns BLOCK_T new tokens of one
request and every query head of one KV head, flattened into BLOCK_M = BLOCK_T * G rows
(row r is token r // G, head r % G, with G the group padded to a power of two), so each
K/V tile is loaded once per group and feeds one `tl.dot` of BLOCK_M rows. Three loops: the prefix and
the new tokens before the block's first query (whole tiles every row sees: no mask), then the tiles up to
the block's last query (causal mask).
FP8 pools: tiles widen in registers, `k_scale` folds into the softmax scale, `v_scale` into the output.
Tree masks (verifying a draft tree): a request's new tokens see its whole prefix and, among themselves, only what its
`[ext_len, ext_len]` row-major mask in `custom_mask` allows (from `mask_indptr[i]`); every new-token tile then runs
the masked loop (no open tiles), and the mask must keep within the causal triangle (a node's ancestors come first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels._checks import (
    FP8_DTYPES,
    check_device,
    check_float,
    check_index,
    check_kv,
    check_last_dim_contiguous,
    check_shape,
    dot_dtype,
    dot_precision,
    next_power_of_2,
)
from radixmesh.kernels.kv_store import from_pool

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(q, acc, m_i, l_i, k_base, v_base, kv_indices_ptr, kv_start, n, hi, rows_t, new_start,
                 stride_k_row, stride_v_row, offs_d, mask_d, qk_scale, mask_ptr, mask_start, ext_len,
                 CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, FROM_SLOTS: tl.constexpr,
                 HAS_MASK: tl.constexpr, FULL: tl.constexpr = False, EVEN_D: tl.constexpr = False):
    """One online-softmax step over keys [n, n + BLOCK_N) ∩ [.., hi).

    FROM_SLOTS: key j's row is the pool slot `kv_indices[kv_start + j]`; else row `kv_start + j` of a
    contiguous tensor (the new tokens' own K/V, `kv_start` then being their first row less `new_start`).
    CAUSAL with HAS_MASK: new token t sees new token j where `mask[mask_start + t * ext_len + j]` is set.
    FULL (not CAUSAL): every key of the tile is below `hi`, so nothing is masked by position; with EVEN_D
    (head_dim == BLOCK_D) the tile's loads carry no mask at all, which the loop's pipelined copies prefer.
    """
    offs_n = n + tl.arange(0, BLOCK_N)
    if FULL:
        mask_n = offs_n >= 0  # (all true: only the causal branch below reads it, and FULL is never causal)
        if FROM_SLOTS:
            rows = tl.load(kv_indices_ptr + kv_start + offs_n).to(tl.int64)
        else:
            rows = kv_start + offs_n
    else:
        mask_n = offs_n < hi
        if FROM_SLOTS:
            rows = tl.load(kv_indices_ptr + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        else:
            rows = kv_start + offs_n
    mask_kv = mask_n[:, None] & mask_d[None, :]
    # [BLOCK_N, BLOCK_D]
    k_ptrs = k_base + rows[:, None] * stride_k_row + offs_d[None, :]
    if FULL and EVEN_D:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=mask_kv, other=0.0)
    # [BLOCK_M, BLOCK_N], unscaled: the scale is applied with the max's subtraction below (one FMA per score)
    s = tl.dot(q, tl.trans(from_pool(k, DOT_DTYPE, KV_FP8)), input_precision=DOT_PRECISION)
    if CAUSAL and HAS_MASK:
        cols = offs_n - new_start
        in_tree = (rows_t < ext_len)[:, None] & mask_n[None, :]
        bits = tl.load(mask_ptr + mask_start + rows_t[:, None] * ext_len + cols[None, :], mask=in_tree, other=0)
        visible = in_tree & (bits != 0)
        s = tl.where(visible, s, float("-inf"))
    elif CAUSAL:
        visible = mask_n[None, :] & ((offs_n - new_start)[None, :] <= rows_t[:, None])
        s = tl.where(visible, s, float("-inf"))
    elif not FULL:
        s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # (log2 units; qk_scale > 0 keeps the max's row)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = v_base + rows[:, None] * stride_v_row + offs_d[None, :]
    if FULL and EVEN_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=mask_kv, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), from_pool(v, DOT_DTYPE, KV_FP8),
                                        input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _extend_kernel(
    q_ptr, k_buf_ptr, v_buf_ptr, k_new_ptr, v_new_ptr, o_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr,
    req_map_ptr, mask_ptr, mask_indptr_ptr, qk_scale, v_scale,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head,
    stride_kn_tok, stride_kn_head, stride_vn_tok, stride_vn_head,
    head_dim,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr, HAS_MAP: tl.constexpr, HEAVY_FIRST: tl.constexpr, NEW_FROM_SLOTS: tl.constexpr,
    HAS_MASK: tl.constexpr, EVEN_D: tl.constexpr,
):
    req = tl.program_id(0)
    if HAS_MAP:  # only the requests listed run here (the others' attention is computed elsewhere)
        req = tl.load(req_map_ptr + req).to(tl.int64)
    kv_head = tl.program_id(1)
    block = tl.program_id(2)
    if HEAVY_FIRST:  # the last query blocks see the most keys: dispatched first, they do not trail the rest
        block = tl.num_programs(2) - 1 - block
    t0 = block * BLOCK_T

    q_start = tl.load(qo_indptr_ptr + req).to(tl.int64)
    ext_len = tl.load(qo_indptr_ptr + req + 1).to(tl.int64) - q_start
    kv_start = tl.load(kv_indptr_ptr + req).to(tl.int64)
    prefix_len = tl.load(kv_indptr_ptr + req + 1).to(tl.int64) - kv_start - ext_len
    # blocks past this request's last new token run no loop and store nothing
    is_live = t0 < ext_len
    prefix_hi = tl.where(is_live, prefix_len, 0)
    # new tokens before the block's first query (whole tiles) are seen by every row: no mask there
    open_hi = tl.where(is_live, prefix_len + (t0 // BLOCK_N) * BLOCK_N, prefix_len)
    mask_start = 0
    if HAS_MASK:  # a tree: every new-token tile is masked
        open_hi = prefix_len
        mask_start = tl.load(mask_indptr_ptr + req).to(tl.int64)
    new_hi = tl.where(is_live, prefix_len + tl.minimum(ext_len, t0 + BLOCK_T), prefix_len)

    offs_r = tl.arange(0, BLOCK_M)
    rows_t = t0 + offs_r // GROUP_PAD
    rows_g = offs_r % GROUP_PAD
    mask_r = (rows_t < ext_len) & (rows_g < GROUP)
    heads = kv_head * GROUP + rows_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    mask_rd = mask_r[:, None] & mask_d[None, :]
    q_rows = (q_start + rows_t) * stride_q_tok + heads * stride_q_head
    # [BLOCK_M, BLOCK_D]
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=mask_rd, other=0.0).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = k_buf_ptr + kv_head * stride_kb_head
    v_base = v_buf_ptr + kv_head * stride_vb_head
    prefix_full = (prefix_hi // BLOCK_N) * BLOCK_N
    for n in range(0, prefix_full, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_base, v_base, kv_indices_ptr, kv_start, n, prefix_hi,
                                     rows_t, prefix_len, stride_kb_slot, stride_vb_slot, offs_d, mask_d, qk_scale,
                                     mask_ptr, mask_start, ext_len,
                                     False, BLOCK_N, DOT_DTYPE, DOT_PRECISION, KV_FP8, True, False, True, EVEN_D)
    if prefix_full < prefix_hi:  # the prefix's last, partial tile
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_base, v_base, kv_indices_ptr, kv_start, prefix_full,
                                     prefix_hi, rows_t, prefix_len, stride_kb_slot, stride_vb_slot, offs_d, mask_d,
                                     qk_scale, mask_ptr, mask_start, ext_len,
                                     False, BLOCK_N, DOT_DTYPE, DOT_PRECISION, KV_FP8, True, False)
    if NEW_FROM_SLOTS:
        new_k = k_base
        new_v = v_base
        new_base = kv_start
        stride_k_row = stride_kb_slot
        stride_v_row = stride_vb_slot
    else:  # the new tokens' K/V from their own rows (the values the pool holds), not through the slot list
        new_k = k_new_ptr + kv_head * stride_kn_head
        new_v = v_new_ptr + kv_head * stride_vn_head
        new_base = q_start - prefix_len
        stride_k_row = stride_kn_tok
        stride_v_row = stride_vn_tok
    for n in range(prefix_len, open_hi, BLOCK_N):  # (whole tiles: open_hi - prefix_len is a multiple of BLOCK_N)
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, new_k, new_v, kv_indices_ptr, new_base, n, open_hi,
                                     rows_t, prefix_len, stride_k_row, stride_v_row, offs_d, mask_d, qk_scale,
                                     mask_ptr, mask_start, ext_len,
                                     False, BLOCK_N, DOT_DTYPE, DOT_PRECISION, KV_FP8, NEW_FROM_SLOTS, False,
                                     True, EVEN_D)
    for n in range(open_hi, new_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, new_k, new_v, kv_indices_ptr, new_base, n, new_hi,
                                     rows_t, prefix_len, stride_k_row, stride_v_row, offs_d, mask_d, qk_scale,
                                     mask_ptr, mask_start, ext_len,
                                     True, BLOCK_N, DOT_DTYPE, DOT_PRECISION, KV_FP8, NEW_FROM_SLOTS, HAS_MASK)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    o_rows = (q_start + rows_t) * stride_o_tok + heads * stride_o_head
    tl.store(o_ptr + o_rows[:, None] + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=mask_rd)


def _block_sizes(head_dim: int, group_pad: int, dtype: torch.dtype, device: torch.device,
                 new_from_slots: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_N, num_warps, num_stages); BLOCK_M = BLOCK_T * group_pad query rows. `new_from_slots`: the
    new tokens' K/V are gathered through their slots too (an FP8 pool), not read from their own rows."""
    block_d = next_power_of_2(head_dim)
    if device.type == "cpu":
        block_m, block_n, num_warps, num_stages = 64, 32, 4, 1
    elif dtype == torch.float32:
        # exact fp32 products run on FMAs, not tensor cores: small tiles compile and run better
        block_m, block_n, num_warps, num_stages = 64, 32, 4, 2
    elif block_d <= 64:
        block_m, block_n, num_warps, num_stages = 128, 64, 4, 3
    elif block_d <= 128:
        # H200, bf16, GQA 4, causal without prefix, 1K / 2K / 3K / 4K new tokens: 266 / 361 / 406 / 433 TFLOP/s;
        # this kernel with the former tiles (128, 32, 4, 3): 187 / 325 / 330 / 369; the kernel before whole tiles
        # lost their masks, with those tiles: 184 / 321 / 331 / 370 (`bench_extend --sweep`,
        # docs/benchmarks/h200-extend-ab-2026-11-30f.jsonl). Not measured on an H100, where that older kernel ran
        # (128, 64, 8, 3) slower than (128, 32, 4, 3).
        # Every K/V tile gathered through the slots (bf16 pool, the same shapes): (128, 32, 4, 3) ran 312 / 314 / 347
        # at 2K / 3K / 4K and 305 with a 512-token prefix, where (128, 64, 8, 3) ran 281 / 305 / 324 and 265
        block_m, block_n, num_warps, num_stages = (128, 32, 4, 3) if new_from_slots else (128, 64, 8, 3)
    else:
        block_m, block_n, num_warps, num_stages = 64, 32, 4, 2
    # a group wider than block_m gets one token per block: still >= 16 rows, as tl.dot needs
    block_t = max(1, block_m // group_pad)
    return block_t, block_n, num_warps, num_stages


def extend_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor,
                         qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                         max_extend_len: int, sm_scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                         blocks: tuple[int, int, int, int] | None = None, req_map: torch.Tensor | None = None,
                         heavy_first: bool = True, k_new: torch.Tensor | None = None,
                         v_new: torch.Tensor | None = None, custom_mask: torch.Tensor | None = None,
                         mask_indptr: torch.Tensor | None = None) -> None:
    """Causal attention of packed new tokens over their requests' prefix plus themselves.

    q, out: `[num_tokens, num_heads, head_dim]`, request i's new tokens at rows
    `qo_indptr[i]:qo_indptr[i + 1]`; k_buffer, v_buffer: `[num_slots, kv_heads, head_dim]`, already
    holding the new tokens' K/V; request i's slots (prefix, then new tokens) are
    `kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`. `max_extend_len` (host int) bounds the new
    tokens of any request and sizes the grid. No host sync. FP8 buffers are read as `fp8 * k_scale`
    and `fp8 * v_scale`. `blocks` (BLOCK_M, BLOCK_N, num_warps, num_stages) replaces the tiles chosen per
    device and dtype (tuning sweeps: `python -m radixmesh.kernels.bench_extend --sweep`). `req_map`
    (int, on the device) lists the requests to compute; the others' rows of `out` are left untouched.
    `heavy_first`: query blocks are dispatched from the last (most keys under the causal mask) to the first,
    so the longest programs do not start last; False keeps the natural order (benchmarks compare the two).
    `k_new`, `v_new`: `[num_tokens, kv_heads, head_dim]`, the new tokens' K/V as stored in the pool (the
    pool's dtype, not FP8), row t for q's row t; attention reads them there instead of through the slots.
    `custom_mask` (bool or uint8, flat) with `mask_indptr` (int, `[batch + 1]`): tree attention among the new tokens;
    request i's new token t sees new token j iff `custom_mask[mask_indptr[i] + t * ext_len_i + j]` (its prefix
    always); the mask must allow no j > t.
    """
    _check_extend_args(q, k_buffer, v_buffer, out, qo_indptr, kv_indptr, kv_indices, max_extend_len)
    assert (custom_mask is None) == (mask_indptr is None), "custom_mask and mask_indptr come together"
    if custom_mask is not None and mask_indptr is not None:
        _check_mask(q, qo_indptr, custom_mask, mask_indptr)
        custom_mask = custom_mask.view(torch.uint8)  # (bool bytes, read as integers)
    assert (k_new is None) == (v_new is None), "k_new and v_new come together"
    if k_new is not None and v_new is not None:
        _check_new_kv(q, k_buffer, k_new, v_new)
    num_tokens, num_heads, head_dim = q.shape
    batch = qo_indptr.shape[0] - 1
    if req_map is not None:
        check_device("req_map", req_map, q.device)
        check_index("req_map", req_map)
        assert req_map.dim() == 1 and req_map.shape[0] <= batch, f"req_map must list <= {batch} requests"
        batch = req_map.shape[0]
    num_kv_heads = k_buffer.shape[1]
    if num_tokens == 0 or batch == 0 or max_extend_len == 0:
        return
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    k_rows, v_rows = (k_new, v_new) if k_new is not None and v_new is not None else (k_buffer, v_buffer)
    from_slots = k_rows is k_buffer
    block_t, block_n, num_warps, num_stages = _block_sizes(head_dim, group_pad, q.dtype, q.device, from_slots)
    if blocks is not None:
        block_m, block_n, num_warps, num_stages = blocks
        assert block_m >= 16 and block_n >= 16, f"tiles must be >= 16 rows, got {blocks}"
        block_t = max(1, block_m // group_pad)
    operand_dtype = dot_dtype(q.dtype, q.device)
    grid = (batch, num_kv_heads, triton.cdiv(max_extend_len, block_t))
    _extend_kernel[grid](
        q, k_buffer, v_buffer, k_rows, v_rows, out, qo_indptr, kv_indptr, kv_indices,
        req_map if req_map is not None else qo_indptr,
        custom_mask if custom_mask is not None else qo_indptr, mask_indptr if mask_indptr is not None else qo_indptr,
        sm_scale * LOG2E * k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        k_rows.stride(0), k_rows.stride(1), v_rows.stride(0), v_rows.stride(1),
        head_dim,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_T=block_t, BLOCK_M=block_t * group_pad,
        BLOCK_D=next_power_of_2(head_dim), BLOCK_N=block_n,
        DOT_DTYPE=operand_dtype, DOT_PRECISION=dot_precision(operand_dtype), KV_FP8=k_buffer.dtype in FP8_DTYPES,
        HAS_MAP=req_map is not None, HEAVY_FIRST=heavy_first, NEW_FROM_SLOTS=from_slots,
        HAS_MASK=custom_mask is not None, EVEN_D=next_power_of_2(head_dim) == head_dim,
        num_warps=num_warps, num_stages=num_stages,
    )


def _check_extend_args(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor,
                       qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                       max_extend_len: int) -> None:
    device = q.device
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("out", out),
                    ("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        check_device(name, t, device)
    assert q.dim() == 3, f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}"
    assert k_buffer.dim() == 3, f"k_buffer must be [num_slots, kv_heads, head_dim], got {tuple(k_buffer.shape)}"
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    assert k_buffer.shape[2] == head_dim, f"k_buffer head_dim {k_buffer.shape[2]} != q head_dim {head_dim}"
    check_shape("v_buffer", v_buffer, tuple(k_buffer.shape))
    check_shape("out", out, tuple(q.shape))
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} is not a multiple of kv_heads {num_kv_heads}"
    assert head_dim >= 16, f"head_dim {head_dim} < 16 is not supported (tl.dot needs K >= 16)"
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("out", out)):
        (check_kv if "buffer" in name else check_float)(name, t)
        check_last_dim_contiguous(name, t)
    assert v_buffer.dtype == k_buffer.dtype, f"v_buffer is {v_buffer.dtype}, k_buffer is {k_buffer.dtype}"
    for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        check_index(name, t)
    assert qo_indptr.shape[0] >= 1, "qo_indptr must have batch + 1 >= 1 entries"
    assert kv_indptr.shape[0] >= qo_indptr.shape[0], (
        f"kv_indptr has {kv_indptr.shape[0]} entries, fewer than qo_indptr's {qo_indptr.shape[0]}")
    assert max_extend_len >= 0, f"max_extend_len must be >= 0, got {max_extend_len}"


def _check_new_kv(q: torch.Tensor, k_buffer: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
    expected = (q.shape[0], k_buffer.shape[1], k_buffer.shape[2])
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        check_device(name, t, q.device)
        check_shape(name, t, expected)
        check_last_dim_contiguous(name, t)
        assert t.dtype == k_buffer.dtype and t.dtype not in FP8_DTYPES, (
            f"{name} is {t.dtype}: the new tokens' rows must be in the pool's dtype ({k_buffer.dtype}), not FP8")


def _check_mask(q: torch.Tensor, qo_indptr: torch.Tensor, custom_mask: torch.Tensor, mask_indptr: torch.Tensor) -> None:
    check_device("custom_mask", custom_mask, q.device)
    check_device("mask_indptr", mask_indptr, q.device)
    assert custom_mask.dim() == 1 and custom_mask.dtype in (torch.bool, torch.uint8), (
        f"custom_mask must be a flat bool or uint8 tensor, got {custom_mask.dtype} {tuple(custom_mask.shape)}")
    assert custom_mask.is_contiguous(), "custom_mask must be contiguous"
    check_index("mask_indptr", mask_indptr)
    assert mask_indptr.dim() == 1 and mask_indptr.shape[0] == qo_indptr.shape[0], (
        f"mask_indptr must have batch + 1 = {qo_indptr.shape[0]} entries, got {tuple(mask_indptr.shape)}")
