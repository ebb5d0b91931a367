"""Triton kernels and the triton backend vs plain PyTorch, at small shapes.

Without CUDA the kernels run on CPU under the Triton interpreter (slow: shapes stay tiny).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # must precede the first import of triton (radixmesh.kernels): @triton.jit reads it then
    os.environ["TRITON_INTERPRET"] = "1"

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from radixmesh.engine.attention.base import AttentionBackend, AttentionLayerSpec, ForwardBatch, ForwardMode
from radixmesh.engine.attention.torch_native import TorchNativeBackend
from radixmesh.engine.attention.triton_backend import TritonBackend
from radixmesh.engine.memory import ReqToTokenPool, TokenToKVPool
from radixmesh.kernels.decode_attention import (
    DecodeScratch,
    choose_num_kv_splits,
    decode_attention_fwd,
)
from radixmesh.kernels.extend_attention import extend_attention_fwd
from radixmesh.kernels.kv_store import build_kv_indices, compute_kv_indptr, fill_kv_indices, store_kv
from radixmesh.kernels.reference import attention_reference, kv_indices_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (atol, rtol) against the float32 reference
TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@dataclass
class Problem:
    q: torch.Tensor  # [num_tokens, heads, head_dim], the new tokens of every request, packed
    k_buf: torch.Tensor  # [num_slots, kv_heads, head_dim], random K in every slot
    v_buf: torch.Tensor
    req_to_token: torch.Tensor  # [rows, max_context]
    req_pool_indices: list[int]
    seq_lens: list[int]  # prefix + new
    new_lens: list[int]

    @property
    def qo_indptr(self) -> list[int]:
        return [sum(self.new_lens[:i]) for i in range(len(self.new_lens) + 1)]


def make_problem(prefix_lens: list[int], new_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, seed: int = 0) -> Problem:
    """Requests in shuffled req_to_token rows, their slots scattered over a random pool."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
    num_slots = sum(seq_lens) + 5
    rows = (torch.randperm(len(seq_lens) + 2, generator=gen)[:len(seq_lens)]).tolist()
    req_to_token = torch.zeros(len(seq_lens) + 2, max(seq_lens) + 3, dtype=torch.int64)
    slots = torch.randperm(num_slots - 1, generator=gen) + 1
    start = 0
    for row, n in zip(rows, seq_lens):
        req_to_token[row, :n] = slots[start:start + n]
        start += n

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    return Problem(q=rand(sum(new_lens), heads, head_dim), k_buf=rand(num_slots, kv_heads, head_dim),
                   v_buf=rand(num_slots, kv_heads, head_dim), req_to_token=req_to_token.to(DEVICE),
                   req_pool_indices=rows, seq_lens=seq_lens, new_lens=new_lens)


def index_tensors(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    return build_kv_indices(p.req_to_token, torch.tensor(p.req_pool_indices, device=DEVICE),
                            torch.tensor(p.seq_lens, device=DEVICE), sum(p.seq_lens))


def assert_close_to_reference(out: torch.Tensor, p: Problem, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                              scale: float) -> None:
    expected = attention_reference(p.q, p.k_buf, p.v_buf, p.qo_indptr, kv_indptr.tolist(), kv_indices, scale)
    atol, rtol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


# ---- kv_store ----------------------------------------------------------------------------------

@pytest.mark.parametrize("buf_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_strided_inputs_to_slots(buf_dtype: torch.dtype) -> None:
    kv_heads, head_dim, n = 3, 64, 5
    k_buf = torch.zeros(12, kv_heads, head_dim, dtype=buf_dtype, device=DEVICE)
    v_buf = torch.zeros_like(k_buf)
    # k/v as views into a fused [n, 2 * kv_heads * head_dim] projection: token stride != kv_heads * head_dim
    fused = torch.randn(n, 2, kv_heads, head_dim, device=DEVICE)
    k, v = fused[:, 0], fused[:, 1]
    loc = torch.tensor([7, 1, 11, 4, 2], device=DEVICE)
    store_kv(k_buf, v_buf, loc, k, v)
    expected_k = torch.zeros_like(k_buf)
    expected_v = torch.zeros_like(v_buf)
    expected_k[loc] = k.to(buf_dtype)
    expected_v[loc] = v.to(buf_dtype)
    if buf_dtype == torch.float32 or DEVICE.type == "cuda":
        assert torch.equal(k_buf, expected_k)
        assert torch.equal(v_buf, expected_v)
    else:  # the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest: allow one ulp
        torch.testing.assert_close(k_buf, expected_k, atol=0, rtol=2**-7)
        torch.testing.assert_close(v_buf, expected_v, atol=0, rtol=2**-7)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("compute_indptr", [False, True], ids=["scan", "in-fill"])
def test_kv_indices_match_row_slices(index_dtype: torch.dtype, compute_indptr: bool) -> None:
    p = make_problem([0, 3, 1500, 0], [1, 9, 2, 0], heads=2, kv_heads=1, head_dim=16, dtype=torch.float32)
    seq_lens = torch.tensor(p.seq_lens, device=DEVICE, dtype=index_dtype)
    if compute_indptr:  # written by the fill kernel itself; stale values must not survive
        kv_indptr = torch.full((len(p.seq_lens) + 1,), 999, dtype=torch.int64, device=DEVICE)
    else:
        kv_indptr = compute_kv_indptr(seq_lens)
    kv_indices = torch.full((sum(p.seq_lens) + 4,), -1, dtype=index_dtype, device=DEVICE)
    fill_kv_indices(p.req_to_token, torch.tensor(p.req_pool_indices, device=DEVICE), seq_lens, kv_indptr, kv_indices,
                    compute_indptr=compute_indptr)
    indptr_ref, indices_ref = kv_indices_reference(p.req_to_token, p.req_pool_indices, p.seq_lens)
    assert kv_indptr.tolist() == indptr_ref
    assert kv_indices[:len(indices_ref)].tolist() == indices_ref.tolist()
    assert kv_indices[len(indices_ref):].tolist() == [-1] * 4  # nothing written past the end


# ---- decode ------------------------------------------------------------------------------------

DECODE_SEQ_LENS = [1, 37, 300, 64]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_kv_splits", [1, 4])
@pytest.mark.parametrize("head_major", [False, True], ids=["req-major", "head-major"])
def test_decode_matches_reference(heads: int, kv_heads: int, head_dim: int, num_kv_splits: int,
                                  head_major: bool) -> None:
    """One split writes the output itself (no merge); more go through the merge; either grid order."""
    p = make_problem([n - 1 for n in DECODE_SEQ_LENS], [1] * len(DECODE_SEQ_LENS), heads, kv_heads, head_dim,
                     torch.float32)
    kv_indptr, kv_indices = index_tensors(p)
    out = torch.full_like(p.q, float("nan"))
    decode_attention_fwd(p.q, p.k_buf, p.v_buf, out, kv_indptr, kv_indices, head_dim**-0.5, num_kv_splits,
                         head_major=head_major)
    assert_close_to_reference(out, p, kv_indptr, kv_indices, head_dim**-0.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_precision(dtype: torch.dtype) -> None:
    p = make_problem([n - 1 for n in DECODE_SEQ_LENS], [1] * len(DECODE_SEQ_LENS), 8, 2, 64, dtype, seed=1)
    kv_indptr, kv_indices = index_tensors(p)
    out = torch.empty_like(p.q)
    scratch = DecodeScratch.allocate(8, 8, 64, 8, DEVICE)  # bigger than needed: views must still line up
    decode_attention_fwd(p.q, p.k_buf, p.v_buf, out, kv_indptr, kv_indices, 0.3, 3, scratch)
    assert_close_to_reference(out, p, kv_indptr, kv_indices, 0.3)


@pytest.mark.parametrize("num_kv_splits", [16, 1])
def test_decode_more_splits_than_tiles_and_empty_request(num_kv_splits: int) -> None:
    """Splits past a short request's end, and a request with no KV at all (padding), stay finite:
    through the merge (16 splits) and when the one split writes the output itself."""
    p = make_problem([0, 0, 9], [1, 1, 1], 4, 2, 32, torch.float32, seed=2)
    p.seq_lens[1] = 0
    kv_indptr, kv_indices = index_tensors(p)
    out = torch.full_like(p.q, float("nan"))
    decode_attention_fwd(p.q, p.k_buf, p.v_buf, out, kv_indptr, kv_indices, 0.2, num_kv_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    # kv_indices holds request 0's one slot, then request 2's ten
    expected = attention_reference(p.q[[0, 2]], p.k_buf, p.v_buf, [0, 1, 2], [0, 1, 11], kv_indices, 0.2)
    torch.testing.assert_close(out[[0, 2]], expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_decode_rows_with_lengths_share_their_requests_slots(num_kv_splits: int) -> None:
    """`kv_lens`: each new token of a short extend is a query row over a prefix of its request's slots (ranges
    overlap), as attention over the request's prefix plus the new tokens up to itself."""
    p = make_problem([6, 40, 0], [3, 1, 4], 8, 2, 64, torch.float32, seed=5)
    kv_indptr, kv_indices = index_tensors(p)
    starts, lens = [], []
    for i, (seq, new) in enumerate(zip(p.seq_lens, p.new_lens)):
        starts += [int(kv_indptr[i])] * new
        lens += range(seq - new + 1, seq + 1)
    out = torch.full_like(p.q, float("nan"))
    decode_attention_fwd(p.q, p.k_buf, p.v_buf, out, torch.tensor([*starts, 0], device=DEVICE), kv_indices,
                         64**-0.5, num_kv_splits, kv_lens=torch.tensor(lens, device=DEVICE))
    assert_close_to_reference(out, p, kv_indptr, kv_indices, 64**-0.5)  # the reference masks causally


def test_choose_num_kv_splits() -> None:
    assert choose_num_kv_splits(1, 8, 100, 132) == 1  # short: one split
    assert choose_num_kv_splits(1, 8, 2048, 132) == 8  # 256 tokens per split at least
    assert choose_num_kv_splits(1, 8, 32768, 132) == 64  # capped by max_kv_splits
    assert choose_num_kv_splits(8, 8, 32768, 132) == 33  # ~16 programs per SM over 132 SMs
    assert choose_num_kv_splits(64, 8, 32768, 132) == 5
    assert choose_num_kv_splits(168, 8, 6144, 132) == 2
    assert choose_num_kv_splits(264, 8, 32768, 132) == 1  # batch already fills the GPU
    assert choose_num_kv_splits(1, 1, 10**6, 132, max_kv_splits=16) == 16


def test_decode_launcher_rejects_bad_arguments() -> None:
    p = make_problem([3], [1], 4, 2, 32, torch.float32)
    kv_indptr, kv_indices = index_tensors(p)
    out = torch.empty_like(p.q)
    with pytest.raises(AssertionError, match="not a multiple"):
        decode_attention_fwd(p.q[:, :3], p.k_buf, p.v_buf, out[:, :3], kv_indptr, kv_indices, 1.0, 1)
    with pytest.raises(AssertionError, match="out has shape"):
        decode_attention_fwd(p.q, p.k_buf, p.v_buf, out[:, :2], kv_indptr, kv_indices, 1.0, 1)
    with pytest.raises(AssertionError, match="kv_indices has dtype"):
        decode_attention_fwd(p.q, p.k_buf, p.v_buf, out, kv_indptr, kv_indices.float(), 1.0, 1)
    with pytest.raises(AssertionError, match="does not fit"):
        decode_attention_fwd(p.q, p.k_buf, p.v_buf, out, kv_indptr, kv_indices, 1.0, 4,
                             DecodeScratch.allocate(1, 4, 32, 2, DEVICE))
    with pytest.raises(AssertionError, match="BLOCK_N must be a power of 2"):
        decode_attention_fwd(p.q, p.k_buf, p.v_buf, out, kv_indptr, kv_indices, 1.0, 1, tiles=(48, 4, 2))


def test_decode_tiles_override_matches_reference() -> None:
    """The tiles a benchmark sweeps (BLOCK_N 16 and 128 here) compute the same attention."""
    p = make_problem([n - 1 for n in DECODE_SEQ_LENS], [1] * len(DECODE_SEQ_LENS), 8, 2, 64, torch.float32, seed=3)
    kv_indptr, kv_indices = index_tensors(p)
    for tiles in ((16, 4, 4), (128, 8, 2)):
        out = torch.full_like(p.q, float("nan"))
        decode_attention_fwd(p.q, p.k_buf, p.v_buf, out, kv_indptr, kv_indices, 0.125, 2, tiles=tiles)
        assert_close_to_reference(out, p, kv_indptr, kv_indices, 0.125)


# ---- extend ------------------------------------------------------------------------------------

PREFIXES = {"no-prefix": [0, 0, 0], "prefix": [70, 0, 130], "whole-tiles": [64, 32, 0]}
"""Prefixes ending inside a key tile (a masked last tile) and on a tile's end (whole tiles alone, unmasked)."""
NEW_LENS = [5, 33, 1]


@pytest.mark.parametrize("prefix", sorted(PREFIXES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1), (6, 2)], ids=["mha", "gqa4", "gqa8", "gqa3"])
@pytest.mark.parametrize("head_dim", [64, 80, 128])  # 80: a padded head (masked loads in every tile)
@pytest.mark.parametrize("heavy_first", [True, False], ids=["heavy-first", "natural-order"])
def test_extend_matches_reference(prefix: str, heads: int, kv_heads: int, head_dim: int, heavy_first: bool) -> None:
    """Either order of the query blocks (several per request here) computes every row once."""
    p = make_problem(PREFIXES[prefix], NEW_LENS, heads, kv_heads, head_dim, torch.float32)
    kv_indptr, kv_indices = index_tensors(p)
    qo_indptr = torch.tensor(p.qo_indptr, device=DEVICE)
    out = torch.full_like(p.q, float("nan"))
    extend_attention_fwd(p.q, p.k_buf, p.v_buf, out, qo_indptr, kv_indptr, kv_indices, max(NEW_LENS),
                         head_dim**-0.5, heavy_first=heavy_first)
    assert_close_to_reference(out, p, kv_indptr, kv_indices, head_dim**-0.5)


def new_token_slots(p: Problem, kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> torch.Tensor:
    """The pool slots of every request's new tokens, in q's row order (each request's list ends with them)."""
    return torch.cat([kv_indices[int(kv_indptr[i + 1]) - n:int(kv_indptr[i + 1])] for i, n in enumerate(p.new_lens)])


def new_token_rows(p: Problem, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens' K/V as the pass's own rows (views of a fused projection, as the model makes them)."""
    fused = torch.empty(len(slots), 3, *p.k_buf.shape[1:], dtype=p.k_buf.dtype, device=DEVICE)
    fused[:, 1] = p.k_buf[slots]
    fused[:, 2] = p.v_buf[slots]
    return fused[:, 1], fused[:, 2]


@pytest.mark.parametrize("blocks", [None, (32, 16, 4, 1), (32, 64, 4, 1)], ids=["default", "8x16", "8x64"])
def test_extend_reads_new_tokens_from_their_rows(blocks: tuple[int, int, int, int] | None) -> None:
    """Given k_new / v_new the new tokens' K/V come from those rows, never from their slots (poisoned here):
    whole tiles before each block's first query unmasked, the rest causal, tiles narrower and wider than a
    block's tokens."""
    p = make_problem([70, 0, 130], [5, 100, 41], 8, 2, 64, torch.float32, seed=4)
    kv_indptr, kv_indices = index_tensors(p)
    new_slots = new_token_slots(p, kv_indptr, kv_indices)
    k_new, v_new = new_token_rows(p, new_slots)
    expected = attention_reference(p.q, p.k_buf, p.v_buf, p.qo_indptr, kv_indptr.tolist(), kv_indices, 0.125)
    p.k_buf[new_slots] = float("nan")
    p.v_buf[new_slots] = float("nan")
    out = torch.full_like(p.q, float("nan"))
    extend_attention_fwd(p.q, p.k_buf, p.v_buf, out, torch.tensor(p.qo_indptr, device=DEVICE), kv_indptr,
                         kv_indices, max(p.new_lens), 0.125, blocks=blocks, k_new=k_new, v_new=v_new)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_extend_new_rows_rejected_unless_pool_dtype() -> None:
    p = make_problem([3], [4], 4, 2, 32, torch.float32)
    kv_indptr, kv_indices = index_tensors(p)
    k_new, v_new = new_token_rows(p, new_token_slots(p, kv_indptr, kv_indices))
    qo_indptr = torch.tensor(p.qo_indptr, device=DEVICE)
    out = torch.empty_like(p.q)
    with pytest.raises(AssertionError, match="pool's dtype"):
        extend_attention_fwd(p.q, p.k_buf, p.v_buf, out, qo_indptr, kv_indptr, kv_indices, 4, 1.0,
                             k_new=k_new.half(), v_new=v_new.half())
    with pytest.raises(AssertionError, match="k_new has shape"):
        extend_attention_fwd(p.q, p.k_buf, p.v_buf, out, qo_indptr, kv_indptr, kv_indices, 4, 1.0,
                             k_new=k_new[:3], v_new=v_new[:3])
    with pytest.raises(AssertionError, match="come together"):
        extend_attention_fwd(p.q, p.k_buf, p.v_buf, out, qo_indptr, kv_indptr, kv_indices, 4, 1.0, k_new=k_new)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_extend_half_precision(dtype: torch.dtype) -> None:
    p = make_problem([40, 0], [70, 3], 8, 2, 64, dtype, seed=3)
    kv_indptr, kv_indices = index_tensors(p)
    out = torch.empty_like(p.q)
    extend_attention_fwd(p.q, p.k_buf, p.v_buf, out, torch.tensor(p.qo_indptr, device=DEVICE), kv_indptr,
                         kv_indices, 70, 0.125)
    assert_close_to_reference(out, p, kv_indptr, kv_indices, 0.125)


# ---- backend -----------------------------------------------------------------------------------

def make_batch(mode: ForwardMode, prefix_lens: list[int], new_lens: list[int], rows: list[int],
               req_pool: ReqToTokenPool, kv_pool: TokenToKVPool, backend: AttentionBackend) -> ForwardBatch:
    """A batch whose requests own `rows`; new tokens' slots are taken from the rows' tables."""
    seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
    loc = torch.cat([req_pool.req_to_token[r, p:s] for r, p, s in zip(rows, prefix_lens, seq_lens)])
    positions = torch.cat([torch.arange(p, s, device=DEVICE) for p, s in zip(prefix_lens, seq_lens)])

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=DEVICE)

    return ForwardBatch(mode=mode, input_ids=torch.zeros(len(loc), dtype=torch.int64, device=DEVICE),
                        positions=positions, out_cache_loc=loc, req_pool_indices=t(rows),
                        seq_lens=t(seq_lens), extend_prefix_lens=t(prefix_lens), extend_seq_lens=t(new_lens),
                        req_to_token_pool=req_pool, token_to_kv_pool=kv_pool,
                        attn_backend=backend,
                        seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=prefix_lens, extend_seq_lens_cpu=new_lens)


def prefixed(context: str) -> Callable[[str], str]:
    """An assert_close message that keeps torch's own text."""
    return lambda msg: f"{context}: {msg}"


LONG_STEPS = [(ForwardMode.EXTEND, [40, 0], [9, 17])] + [(ForwardMode.DECODE, [49 + i, 17 + i], [1, 1])
                                                          for i in range(2)]
SHORT_STEPS = [(ForwardMode.EXTEND, [40, 0], [9, 17]), (ForwardMode.EXTEND, [49, 17], [3, 3]),
               (ForwardMode.DECODE, [52, 20], [1, 1]), (ForwardMode.EXTEND, [53, 21], [5, 2])]
"""A prefill, then extends short enough for the decode kernel's rows (a verify pass's shape), uniform and not."""


def run_layer(backend_cls: type, dtype: torch.dtype, graph_plan: bool = False,
              steps: list[tuple[ForwardMode, list[int], list[int]]] = LONG_STEPS,
              ) -> tuple[list[torch.Tensor], TokenToKVPool]:
    """Extend (one request with a cached prefix, one without), then two decode steps (`steps`); layer 1 of 2.

    `graph_plan`: plan decode steps, and short extends of one length, as a CUDA-graph replay does (static
    buffers, no host lengths).
    """
    torch.manual_seed(0)
    heads, kv_heads, head_dim = 6, 2, 64
    layer = AttentionLayerSpec(1, heads, kv_heads, head_dim, head_dim**-0.5)
    req_pool = ReqToTokenPool(4, 128, DEVICE)
    kv_pool = TokenToKVPool(200, 2, kv_heads, head_dim, dtype, DEVICE)
    for buf in kv_pool.k_buffers + kv_pool.v_buffers:
        buf.zero_()  # so the pools compare equal outside the written slots
    rows = [2, 0]
    req_pool.req_to_token[2, :60] = torch.randperm(100, device=DEVICE)[:60] + 1
    req_pool.req_to_token[0, :60] = torch.randperm(100, device=DEVICE)[:60] + 101
    # a cached prefix of 40 tokens for the first request, as an earlier pass would have left it
    prefix = req_pool.req_to_token[2, :40]
    kv_pool.set_kv(1, prefix, torch.randn(40, kv_heads, head_dim, device=DEVICE),
                   torch.randn(40, kv_heads, head_dim, device=DEVICE))
    backend = backend_cls()
    if graph_plan:
        backend.init_cuda_graph_state(4, 128, kv_pool, heads)
    outs = []
    for mode, prefix_lens, new_lens in steps:
        fb = make_batch(mode, prefix_lens, new_lens, rows, req_pool, kv_pool, backend)
        n = sum(new_lens)
        q = torch.randn(n, heads, head_dim, device=DEVICE).to(dtype)
        k = torch.randn(n, kv_heads, head_dim, device=DEVICE).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, device=DEVICE).to(dtype)
        if graph_plan and mode is ForwardMode.DECODE:
            backend.init_forward_metadata_graph(fb, fb.batch_size)
        elif graph_plan and mode is ForwardMode.EXTEND and len(set(new_lens)) == 1 and new_lens[0] <= 8:
            indices = torch.zeros(4 * 128, dtype=torch.int32, device=DEVICE)
            backend.init_extend_metadata_graph(fb, new_lens[0], torch.zeros(5, dtype=torch.int64, device=DEVICE),
                                               indices)
            assert backend.metadata.short_rows is not None and backend.metadata.short_graph
        else:
            backend.init_forward_metadata(fb)
            if isinstance(backend, TritonBackend) and mode is ForwardMode.EXTEND:
                assert (backend.metadata.short_rows is not None) == (max(new_lens) <= 8), "short extends: decode rows"
        outs.append(backend.forward(q, k, v, layer, fb))
    return outs, kv_pool


@pytest.mark.parametrize("dtype,graph_plan", [(torch.float32, False), (torch.bfloat16, False),
                                              (torch.float32, True)], ids=["fp32", "bf16", "fp32-graph-plan"])
@pytest.mark.parametrize("steps", [LONG_STEPS, SHORT_STEPS], ids=["long", "short-extends"])
def test_backend_matches_torch_native(dtype: torch.dtype, graph_plan: bool,
                                      steps: list[tuple[ForwardMode, list[int], list[int]]]) -> None:
    got, got_pool = run_layer(TritonBackend, dtype, graph_plan, steps)
    want, want_pool = run_layer(TorchNativeBackend, dtype, steps=steps)
    atol, rtol = TOLERANCE[dtype]
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"step {step}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        torch.testing.assert_close(g.float(), w.float(), atol=atol, rtol=rtol, msg=prefixed(f"step {step}"))
    assert torch.equal(got_pool.k_buffers[1], want_pool.k_buffers[1])
    assert torch.equal(got_pool.v_buffers[1], want_pool.v_buffers[1])


def test_registry_creates_triton_backend() -> None:
    from radixmesh.engine.attention.registry import create_backend

    assert isinstance(create_backend("triton"), TritonBackend)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the scheduler factory runs on CPU: triton needs the interpreter")
def test_scheduler_greedy_tokens_match_torch_native() -> None:
    """A tiny model end to end: prefill, radix-cache prefix hits and decode give the same greedy tokens."""
    from .scheduler_factory import clone, make_requests, make_scheduler, run_until_idle, tiny_model_config

    reqs = make_requests(4, seed=1, shared_prefix_len=12, max_new_tokens=4)
    tokens: dict[str, dict[str, list[int]]] = {}
    cached: dict[str, dict[str, int]] = {}
    for backend in ("torch-native", "triton"):
        sched, col = make_scheduler(tiny_model_config(head_dim=16), attention_backend=backend)
        sched.add_request(clone(reqs[0]))
        run_until_idle(sched)
        for req in reqs[1:]:
            sched.add_request(clone(req))
        run_until_idle(sched)
        tokens[backend], cached[backend] = col.tokens, col.cached
    assert all(n == 12 for rid, n in cached["triton"].items() if rid != reqs[0].rid)  # prefixes came from cache
    assert tokens["triton"] == tokens["torch-native"]
