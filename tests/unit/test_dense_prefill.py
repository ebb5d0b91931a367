"""Prefix-free long prompts through SDPA (cuDNN on CUDA) next to the Triton extend kernel.

Without CUDA the Triton kernel runs under the interpreter and SDPA on its CPU kernels (shapes stay tiny;
the threshold is lowered so the dense path runs at all).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the first import of triton

import pytest

from radixmesh.engine.attention.base import AttentionLayerSpec, ForwardMode
from radixmesh.engine.attention.dense_prefill import DenseAttention, DensePlan, plan_dense
from radixmesh.engine.attention.torch_native import TorchNativeBackend
from radixmesh.engine.attention.triton_backend import TritonBackend
from radixmesh.engine.memory import ReqToTokenPool, TokenToKVPool
from radixmesh.kernels.extend_attention import extend_attention_fwd
from tests.unit.test_triton_kernels import (
    DEVICE,
    TOLERANCE,
    assert_close_to_reference,
    index_tensors,
    make_batch,
    make_problem,
)

# SDPA backends that run on this machine's device (the CPU has no cuDNN)
BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION") if DEVICE.type == "cuda" else ("FLASH_ATTENTION", "MATH")


def test_plan_takes_long_prefix_free_requests_only() -> None:
    plan = plan_dense([40, 0, 0, 0, 5], [9, 17, 3, 12, 30], min_tokens=8)
    assert plan == DensePlan(ranges=((9, 26), (29, 41)), rest=(0, 2, 4), rest_max_extend_len=30)
    assert plan_dense([0, 0], [20, 8], min_tokens=8) == DensePlan(((0, 20), (20, 28)), (), 0)


@pytest.mark.parametrize("prefix_lens,new_lens,min_tokens", [([40, 3], [9, 30], 8), ([0, 0], [7, 5], 8),
                                                             ([0], [100], 0)], ids=["prefixes", "short", "off"])
def test_plan_is_none_without_a_dense_request(prefix_lens: list[int], new_lens: list[int], min_tokens: int) -> None:
    assert plan_dense(prefix_lens, new_lens, min_tokens) is None


def test_extend_kernel_computes_only_the_mapped_requests() -> None:
    p = make_problem([40, 0, 0, 7], [9, 17, 3, 12], 8, 2, 64, torch.float32, seed=5)
    kv_indptr, kv_indices = index_tensors(p)
    qo_indptr = torch.tensor(p.qo_indptr, device=DEVICE)
    out = torch.full_like(p.q, 123.0)
    req_map = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    extend_attention_fwd(p.q, p.k_buf, p.v_buf, out, qo_indptr, kv_indptr, kv_indices, 12, 0.125, req_map=req_map)
    untouched = torch.cat([out[9:26], out[26:29]])
    assert bool((untouched == 123.0).all()), "rows of requests outside the map were written"
    full = torch.empty_like(p.q)
    extend_attention_fwd(p.q, p.k_buf, p.v_buf, full, qo_indptr, kv_indptr, kv_indices, 17, 0.125)
    assert_close_to_reference(full, p, kv_indptr, kv_indices, 0.125)
    for lo, hi in ((0, 9), (29, 41)):
        torch.testing.assert_close(out[lo:hi], full[lo:hi])


def _extend_once(backend: TritonBackend | TorchNativeBackend, dtype: torch.dtype, prefix_lens: list[int],
                 new_lens: list[int]) -> tuple[torch.Tensor, TokenToKVPool]:
    """One layer's extend pass over fresh pools (same seed for every backend): output and pool."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim = 8, 2, 64
    layer = AttentionLayerSpec(0, heads, kv_heads, head_dim, head_dim**-0.5)
    rows = list(range(len(new_lens)))
    req_pool = ReqToTokenPool(len(rows), 128, DEVICE)
    kv_pool = TokenToKVPool(len(rows) * 128 + 1, 1, kv_heads, head_dim, dtype, DEVICE)
    for buf in kv_pool.k_buffers + kv_pool.v_buffers:
        buf.zero_()
    req_pool.req_to_token[:, :] = (torch.randperm(len(rows) * 128, device=DEVICE) + 1).view(len(rows), 128)
    for row, p in zip(rows, prefix_lens):
        loc = req_pool.req_to_token[row, :p]
        kv_pool.set_kv(0, loc, torch.randn(p, kv_heads, head_dim, device=DEVICE),
                       torch.randn(p, kv_heads, head_dim, device=DEVICE))
    fb = make_batch(ForwardMode.EXTEND, prefix_lens, new_lens, rows, req_pool, kv_pool, backend)
    n = sum(new_lens)
    q = torch.randn(n, heads, head_dim, device=DEVICE).to(dtype)
    k = torch.randn(n, kv_heads, head_dim, device=DEVICE).to(dtype)
    v = torch.randn(n, kv_heads, head_dim, device=DEVICE).to(dtype)
    backend.init_forward_metadata(fb)
    return backend.forward(q, k, v, layer, fb), kv_pool


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("prefix_lens,new_lens", [([40, 0, 0, 0], [9, 17, 3, 12]), ([0, 0], [20, 33]), ([0], [30])],
                         ids=["mixed", "all-dense", "one-request"])
def test_backend_with_dense_requests_matches_torch_native(dtype: torch.dtype, prefix_lens: list[int],
                                                          new_lens: list[int]) -> None:
    dense = DenseAttention(BACKENDS)
    triton = TritonBackend(dense_min_tokens=8, dense=dense)
    got, got_pool = _extend_once(triton, dtype, prefix_lens, new_lens)
    meta = triton.metadata
    assert meta is not None and meta.dense is not None, "no request went to the dense path"
    assert dense.enabled, "the dense path turned itself off"
    want, want_pool = _extend_once(TorchNativeBackend(), dtype, prefix_lens, new_lens)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    assert torch.equal(got_pool.k_buffers[0], want_pool.k_buffers[0]), "the new tokens' K were not stored"
    assert torch.equal(got_pool.v_buffers[0], want_pool.v_buffers[0])


def test_a_refusing_library_falls_back_to_the_kernel_and_stays_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", refuse)
    dense = DenseAttention(BACKENDS)
    triton = TritonBackend(dense_min_tokens=8, dense=dense)
    got, _ = _extend_once(triton, torch.bfloat16, [40, 0], [9, 17])
    assert not dense.enabled
    want, _ = _extend_once(TorchNativeBackend(), torch.bfloat16, [40, 0], [9, 17])
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    _extend_once(triton, torch.bfloat16, [0], [30])
    assert triton.metadata is not None and triton.metadata.dense is None, "a disabled path was planned again"


def test_fp32_and_fp8_pools_are_not_planned_dense() -> None:
    for dtype in (torch.float32, torch.float8_e4m3fn):
        backend = TritonBackend(dense_min_tokens=8, dense=DenseAttention(BACKENDS))
        kv_pool = TokenToKVPool(257, 1, 2, 64, dtype, DEVICE)
        req_pool = ReqToTokenPool(2, 128, DEVICE)
        req_pool.req_to_token[:, :] = (torch.randperm(256, device=DEVICE) + 1).view(2, 128)
        fb = make_batch(ForwardMode.EXTEND, [0, 0], [20, 30], [0, 1], req_pool, kv_pool, backend)
        backend.init_forward_metadata(fb)
        assert backend.metadata is not None and backend.metadata.dense is None, dtype


def test_off_unless_enabled() -> None:
    backend = TritonBackend()
    kv_pool = TokenToKVPool(5000, 1, 2, 64, torch.bfloat16, DEVICE)
    req_pool = ReqToTokenPool(1, 4096, DEVICE)
    req_pool.req_to_token[0, :4000] = torch.arange(1, 4001, device=DEVICE)
    for enable, planned in ((False, False), (True, True)):
        if enable:
            backend.enable_dense_prefill()
        fb = make_batch(ForwardMode.EXTEND, [0], [4000], [0], req_pool, kv_pool, backend)
        backend.init_forward_metadata(fb)
        assert backend.metadata is not None and (backend.metadata.dense is not None) == planned


def test_lengths_are_padded_to_buckets_and_warm_up_builds_each_once() -> None:
    dense = DenseAttention(BACKENDS, bucket=16)
    assert [dense.padded_len(n) for n in (1, 16, 17, 40)] == [16, 16, 32, 48]
    assert dense.warm_up(4, 2, 32, torch.bfloat16, DEVICE, min_tokens=20, max_tokens=50) == 3  # 32, 48, 64
    assert dense.warm_up(4, 2, 32, torch.bfloat16, DEVICE, min_tokens=0, max_tokens=50) == 0
    assert dense.enabled


def test_padding_rows_never_reach_real_rows() -> None:
    """A request padded to its bucket gets the rows it would get unpadded; nothing NaN leaks in from the padding."""
    torch.manual_seed(1)
    q = torch.randn(21, 4, 32, device=DEVICE).to(torch.bfloat16)
    k = torch.randn(21, 2, 32, device=DEVICE).to(torch.bfloat16)
    v = torch.randn(21, 2, 32, device=DEVICE).to(torch.bfloat16)
    plan = DensePlan(ranges=((0, 21),), rest=(), rest_max_extend_len=0)
    padded = DenseAttention(BACKENDS, bucket=16).run(q, k, v, torch.empty_like(q), plan, 0.2)
    exact = DenseAttention(BACKENDS, bucket=1).run(q, k, v, torch.empty_like(q), plan, 0.2)
    assert padded is not None and exact is not None
    assert padded.shape == q.shape and padded.is_contiguous() and not padded.isnan().any()
    torch.testing.assert_close(padded, exact)


def test_a_backend_without_a_dense_path_says_the_flag_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        TorchNativeBackend().enable_dense_prefill()
    assert "TorchNativeBackend backend has no dense prefill path" in caplog.text
