"""Triton kernels vs the PyTorch reference at real shapes, on a CUDA device (skipped without one)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # every test here is skipped then, but importing the kernels must not fix triton to compiled
    # mode before the CPU unit tests (which need the interpreter) import them
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from radixmesh.engine.attention.base import AttentionLayerSpec, ForwardBatch, ForwardMode
from radixmesh.engine.attention.torch_native import TorchNativeBackend
from radixmesh.engine.attention.triton_backend import TritonBackend
from radixmesh.engine.memory import ReqToTokenPool, TokenToKVPool
from radixmesh.kernels.decode_attention import (
    DecodeScratch,
    choose_num_kv_splits,
    decode_attention_fwd,
    get_num_sms,
)
from radixmesh.kernels.extend_attention import extend_attention_fwd
from radixmesh.kernels.kv_store import build_kv_indices, store_kv
from radixmesh.kernels.reference import attention_reference, kv_indices_reference

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
# (atol, rtol) vs the float32 reference; bf16 outputs carry ~3 significant digits
TOLERANCE = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3), torch.float32: (1e-4, 1e-4)}


def make_pool(seq_lens: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_buf, v_buf, kv_indptr, kv_indices): each request's slots scattered over a random pool."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    num_slots = sum(seq_lens) + 1
    k_buf = torch.randn(num_slots, kv_heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    v_buf = torch.randn(num_slots, kv_heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    rows = len(seq_lens)
    req_to_token = torch.zeros(rows, max(seq_lens), dtype=torch.int64, device=DEVICE)
    slots = torch.randperm(num_slots - 1, generator=gen, device=DEVICE) + 1
    start = 0
    for row, n in enumerate(seq_lens):
        req_to_token[row, :n] = slots[start:start + n]
        start += n
    req_pool_indices = torch.arange(rows, device=DEVICE).flip(0)  # rows in reverse: indices are not identity
    lens = torch.tensor(seq_lens, device=DEVICE).flip(0)
    kv_indptr, kv_indices = build_kv_indices(req_to_token, req_pool_indices, lens, sum(seq_lens))
    indptr_ref, indices_ref = kv_indices_reference(req_to_token, req_pool_indices.tolist(), lens.tolist())
    assert kv_indptr.tolist() == indptr_ref and torch.equal(kv_indices, indices_ref)
    return k_buf, v_buf, kv_indptr, kv_indices


def check(out: torch.Tensor, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, qo_indptr: list[int],
          kv_indptr: torch.Tensor, kv_indices: torch.Tensor, scale: float) -> None:
    expected = attention_reference(q, k_buf, v_buf, qo_indptr, kv_indptr.tolist(), kv_indices, scale)
    atol, rtol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


def run_decode(seq_lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
               num_kv_splits: int | None = None) -> None:
    k_buf, v_buf, kv_indptr, kv_indices = make_pool(seq_lens, kv_heads, head_dim, dtype)
    batch = len(seq_lens)
    q = torch.randn(batch, heads, head_dim, device=DEVICE).to(dtype)
    out = torch.empty_like(q)
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(batch, kv_heads, max(seq_lens), get_num_sms(DEVICE))
    decode_attention_fwd(q, k_buf, v_buf, out, kv_indptr, kv_indices, head_dim**-0.5, num_kv_splits)
    check(out, q, k_buf, v_buf, list(range(batch + 1)), kv_indptr, kv_indices, head_dim**-0.5)


def test_decode_batch64_seq2048_llama8b_shape() -> None:
    run_decode([2048] * 64, 32, 8, 128, torch.bfloat16)


@pytest.mark.parametrize("heads,kv_heads", [(32, 32), (32, 8), (32, 4)], ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_ragged(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(heads + kv_heads + head_dim)
    seq_lens = [1, 2, 63, 64, 65, 8191, *torch.randint(1, 5000, (18,), generator=gen).tolist()]
    run_decode(seq_lens, heads, kv_heads, head_dim, dtype)


@pytest.mark.parametrize("num_kv_splits", [1, 7, 64])
def test_decode_long_context_split_counts(num_kv_splits: int) -> None:
    run_decode([32768, 100], 32, 8, 128, torch.bfloat16, num_kv_splits)


def test_decode_fp32_and_head_dim_256() -> None:
    run_decode([1, 700, 3000], 16, 4, 256, torch.float32)


def test_decode_replays_in_cuda_graph() -> None:
    """Captured once with fixed splits and scratch; replays follow new lengths written in place."""
    heads, kv_heads, head_dim, batch, max_kv = 32, 8, 128, 8, 4096
    k_buf, v_buf, _, _ = make_pool([max_kv] * batch, kv_heads, head_dim, torch.bfloat16)
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int64, device=DEVICE)
    kv_indices = torch.empty(batch * max_kv, dtype=torch.int64, device=DEVICE)
    q = torch.randn(batch, heads, head_dim, device=DEVICE).to(torch.bfloat16)
    out = torch.empty_like(q)
    splits = choose_num_kv_splits(batch, kv_heads, max_kv, get_num_sms(DEVICE))
    scratch = DecodeScratch.allocate(batch, heads, head_dim, splits, DEVICE)

    def set_lens(seq_lens: list[int]) -> None:
        lens = torch.tensor(seq_lens, device=DEVICE)
        kv_indptr[1:] = lens.cumsum(0)
        kv_indices[:sum(seq_lens)] = torch.randperm(k_buf.shape[0] - 1, device=DEVICE)[:sum(seq_lens)] + 1

    def launch() -> None:
        decode_attention_fwd(q, k_buf, v_buf, out, kv_indptr, kv_indices, head_dim**-0.5, splits, scratch)

    set_lens([max_kv] * batch)
    launch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for seq_lens in ([5, 4096, 1, 300, 2000, 64, 65, 3333], [4096] * batch):
        set_lens(seq_lens)
        graph.replay()
        torch.cuda.synchronize()
        check(out, q, k_buf, v_buf, list(range(batch + 1)), kv_indptr, kv_indices[:sum(seq_lens)], head_dim**-0.5)


@pytest.mark.parametrize("heads,kv_heads", [(32, 32), (32, 8), (32, 4)], ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("prefix", ["none", "long"])
def test_extend_ragged_with_prefixes(heads: int, kv_heads: int, head_dim: int, prefix: str) -> None:
    new_lens = [512, 1, 777, 100, 2048]
    prefix_lens = [0] * 5 if prefix == "none" else [4096, 8000, 1, 300, 1024]
    seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
    k_buf, v_buf, kv_indptr, kv_indices = make_pool(seq_lens[::-1], kv_heads, head_dim, torch.bfloat16)
    # make_pool lists requests in reverse row order; undo so request i has seq_lens[i]
    assert (kv_indptr[1:] - kv_indptr[:-1]).tolist() == seq_lens
    qo = [0]
    for n in new_lens:
        qo.append(qo[-1] + n)
    q = torch.randn(qo[-1], heads, head_dim, device=DEVICE).to(torch.bfloat16)
    out = torch.empty_like(q)
    extend_attention_fwd(q, k_buf, v_buf, out, torch.tensor(qo, device=DEVICE), kv_indptr, kv_indices,
                         max(new_lens), head_dim**-0.5)
    check(out, q, k_buf, v_buf, qo, kv_indptr, kv_indices, head_dim**-0.5)


def test_store_kv_large() -> None:
    k_buf = torch.zeros(100_001, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    v_buf = torch.zeros_like(k_buf)
    loc = torch.randperm(100_000, device=DEVICE)[:8192] + 1
    k = torch.randn(8192, 8, 128, device=DEVICE)
    v = torch.randn(8192, 8, 128, device=DEVICE)
    store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf[loc], k.to(torch.bfloat16)) and torch.equal(v_buf[loc], v.to(torch.bfloat16))


@pytest.mark.parametrize("prefix_lens,new_lens", [([1000, 0, 37], [200, 513, 1]), ([0, 1000, 0], [2048, 200, 1600])],
                         ids=["triton-only", "with-dense-prefill"])
def test_backend_matches_torch_native_gpu(prefix_lens: list[int], new_lens: list[int]) -> None:
    """One layer: extend with cached prefixes, then decode steps; both backends on their own pools. With
    `--enable-dense-prefill` the second case sends its two long prefix-free prompts to cuDNN (dense_prefill.py),
    its middle request to the kernel."""
    heads, kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    layer = AttentionLayerSpec(0, heads, kv_heads, head_dim, head_dim**-0.5)
    dense_expected = max(n for p, n in zip(prefix_lens, new_lens) if p == 0) >= 1536
    results = []
    for backend_cls in (TritonBackend, TorchNativeBackend):
        torch.manual_seed(0)
        req_pool = ReqToTokenPool(4, 4096, DEVICE)
        kv_pool = TokenToKVPool(7000, 1, kv_heads, head_dim, dtype, DEVICE)
        rows = [3, 1, 0]
        slots = torch.randperm(7000, device=DEVICE) + 1
        for i, row in enumerate(rows):
            req_pool.req_to_token[row, :2100] = slots[i * 2100:(i + 1) * 2100]
        for row, p in zip(rows, prefix_lens):
            loc = req_pool.req_to_token[row, :p]
            kv_pool.set_kv(0, loc, torch.randn(p, kv_heads, head_dim, device=DEVICE),
                           torch.randn(p, kv_heads, head_dim, device=DEVICE))
        backend = backend_cls()
        backend.enable_dense_prefill()
        outs = []
        steps = [(ForwardMode.EXTEND, prefix_lens, new_lens)]
        steps += [(ForwardMode.DECODE, [p + n + i for p, n in zip(prefix_lens, new_lens)], [1, 1, 1])
                  for i in range(3)]
        for mode, pre, new in steps:
            seq = [p + n for p, n in zip(pre, new)]
            loc = torch.cat([req_pool.req_to_token[r, p:s] for r, p, s in zip(rows, pre, seq)])
            fb = ForwardBatch(
                mode=mode, input_ids=torch.zeros(len(loc), dtype=torch.int64, device=DEVICE),
                positions=torch.cat([torch.arange(p, s, device=DEVICE) for p, s in zip(pre, seq)]),
                out_cache_loc=loc, req_pool_indices=torch.tensor(rows, device=DEVICE),
                seq_lens=torch.tensor(seq, device=DEVICE), extend_prefix_lens=torch.tensor(pre, device=DEVICE),
                extend_seq_lens=torch.tensor(new, device=DEVICE), req_to_token_pool=req_pool,
                token_to_kv_pool=kv_pool, attn_backend=backend, seq_lens_cpu=seq, extend_prefix_lens_cpu=pre,
                extend_seq_lens_cpu=new)
            n = sum(new)
            q = torch.randn(n, heads, head_dim, device=DEVICE).to(dtype)
            k = torch.randn(n, kv_heads, head_dim, device=DEVICE).to(dtype)
            v = torch.randn(n, kv_heads, head_dim, device=DEVICE).to(dtype)
            backend.init_forward_metadata(fb)
            outs.append(backend.forward(q, k, v, layer, fb))
            if isinstance(backend, TritonBackend) and mode is ForwardMode.EXTEND:
                assert backend.metadata is not None
                assert (backend.metadata.dense is not None) == dense_expected and backend.dense.enabled
        results.append(outs)
    for step, (got, want) in enumerate(zip(*results)):
        try:
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        except AssertionError as err:
            raise AssertionError(f"step {step}: {err}") from None


def test_backend_decode_replays_in_cuda_graph() -> None:
    """TritonBackend's graph planning captured with the layer, replayed on new ragged batches."""
    heads, kv_heads, head_dim, dtype, bs, context = 32, 8, 128, torch.bfloat16, 8, 4096
    layer = AttentionLayerSpec(0, heads, kv_heads, head_dim, head_dim**-0.5)
    req_pool = ReqToTokenPool(bs, context, DEVICE)
    kv_pool = TokenToKVPool(bs * context, 1, kv_heads, head_dim, dtype, DEVICE)
    kv_pool.k_buffers[0].normal_()
    kv_pool.v_buffers[0].normal_()
    req_pool.req_to_token.copy_((torch.randperm(bs * context, device=DEVICE) + 1).view(bs, context))
    backend = TritonBackend()
    assert backend.init_cuda_graph_state(bs, context, kv_pool, heads) >= bs * 2000

    def zeros(*shape: int, dt: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dt, device=DEVICE)

    seq_lens, rows, loc = torch.ones(bs, dtype=torch.int64, device=DEVICE), zeros(bs), zeros(bs)
    q, k, v = zeros(bs, heads, head_dim, dt=dtype), zeros(bs, kv_heads, head_dim, dt=dtype), zeros(
        bs, kv_heads, head_dim, dt=dtype)
    fb = ForwardBatch(mode=ForwardMode.DECODE, input_ids=zeros(bs), positions=zeros(bs), out_cache_loc=loc,
                      req_pool_indices=rows, seq_lens=seq_lens, extend_prefix_lens=seq_lens - 1,
                      extend_seq_lens=torch.ones_like(seq_lens), req_to_token_pool=req_pool, token_to_kv_pool=kv_pool,
                      attn_backend=backend, seq_lens_cpu=[1] * bs, extend_prefix_lens_cpu=[0] * bs,
                      extend_seq_lens_cpu=[1] * bs)

    def run() -> torch.Tensor:
        backend.init_forward_metadata_graph(fb, bs)
        return backend.forward(q, k, v, layer, fb)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = run()
    for lens in ([1, 4096, 37, 2000, 64, 65, 3999, 512], [4096] * bs):
        order = torch.randperm(bs).tolist()
        seq_lens.copy_(torch.tensor(lens))
        rows.copy_(torch.tensor(order))
        loc.copy_(req_pool.req_to_token[order, [n - 1 for n in lens]])
        for t in (q, k, v):
            t.normal_()
        graph.replay()
        torch.cuda.synchronize()
        ref = TorchNativeBackend()
        eager = ForwardBatch(mode=ForwardMode.DECODE, input_ids=zeros(bs), positions=seq_lens - 1, out_cache_loc=loc,
                             req_pool_indices=rows, seq_lens=seq_lens, extend_prefix_lens=seq_lens - 1,
                             extend_seq_lens=torch.ones_like(seq_lens), req_to_token_pool=req_pool,
                             token_to_kv_pool=kv_pool, attn_backend=ref, seq_lens_cpu=lens,
                             extend_prefix_lens_cpu=[n - 1 for n in lens], extend_seq_lens_cpu=[1] * bs)
        ref.init_forward_metadata(eager)
        want = ref.forward(q, k, v, layer, eager)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
