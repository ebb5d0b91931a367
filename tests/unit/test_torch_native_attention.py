"""The reference backend's batched decode (one masked SDPA call per chunk of requests) gives what one
call per request gives, whatever the context lengths and however the batch is chunked."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.attention import torch_native
from radixmesh.engine.attention.base import AttentionLayerSpec, ForwardMode
from radixmesh.engine.attention.torch_native import TorchNativeBackend
from radixmesh.engine.memory import ReqToTokenPool, TokenToKVPool
from tests.unit.test_triton_kernels import make_batch

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 32
LAYER = AttentionLayerSpec(0, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)


@pytest.mark.parametrize("gather_bytes", [torch_native.DECODE_GATHER_BYTES, 1, 40_000],
                         ids=["one-call", "one-request-per-call", "chunks"])
def test_batched_decode_equals_one_call_per_request(gather_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_native, "DECODE_GATHER_BYTES", gather_bytes)
    torch.manual_seed(0)
    req_pool = ReqToTokenPool(8, 256, "cpu")
    kv_pool = TokenToKVPool(1000, 1, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    kv_pool.k_buffers[0][0] = float("nan")  # the dummy slot: padding reads it, the mask must hide it
    kv_pool.v_buffers[0][0] = float("nan")
    rows, seq_lens = [5, 1, 3, 0, 7], [3, 200, 1, 64, 17]
    slots = torch.randperm(999)[: sum(seq_lens)] + 1
    start = 0
    for row, seq_len in zip(rows, seq_lens):
        req_pool.req_to_token[row, :seq_len] = slots[start:start + seq_len]
        kv_pool.set_kv(0, slots[start:start + seq_len], torch.randn(seq_len, KV_HEADS, HEAD_DIM),
                       torch.randn(seq_len, KV_HEADS, HEAD_DIM))
        start += seq_len
    q = torch.randn(len(rows), HEADS, HEAD_DIM)
    k, v = torch.randn(len(rows), KV_HEADS, HEAD_DIM), torch.randn(len(rows), KV_HEADS, HEAD_DIM)
    prefix_lens = [n - 1 for n in seq_lens]

    backend = TorchNativeBackend()
    batch = make_batch(ForwardMode.DECODE, prefix_lens, [1] * len(rows), rows, req_pool, kv_pool, backend)
    backend.init_forward_metadata(batch)
    got = backend.forward(q, k, v, LAYER, batch)

    for i, row in enumerate(rows):  # each request alone: the per-request path
        alone = TorchNativeBackend()
        one = make_batch(ForwardMode.DECODE, prefix_lens[i:i + 1], [1], [row], req_pool, kv_pool, alone)
        alone.init_forward_metadata(one)
        want = alone.forward(q[i:i + 1], k[i:i + 1], v[i:i + 1], LAYER, one)
        torch.testing.assert_close(got[i:i + 1], want, atol=2e-6, rtol=1e-5)
    assert not got.isnan().any()
