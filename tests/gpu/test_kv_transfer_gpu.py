"""KV gather/scatter kernels at a real shape (Llama-3.1-8B KV: 32 layers, 8 KV heads, head dim 128, bf16)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # every test here is skipped then, but importing the kernels must not fix triton to compiled
    # mode before the CPU unit tests (which need the interpreter) import them
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from radixmesh.kernels.kv_transfer import gather_kv, scatter_kv
from radixmesh.kernels.kv_transfer_ref import gather_kv_torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("num_tokens", [1, 1000, 4000])
def test_gather_scatter_at_llama_8b_shape(num_tokens: int) -> None:
    device = torch.device("cuda")
    layers, slots_total, heads, dim = 32, 8192, 8, 128
    gen = torch.Generator(device=device).manual_seed(0)
    k_src = [torch.randn(slots_total, heads, dim, generator=gen, device=device).bfloat16() for _ in range(layers)]
    v_src = [torch.randn(slots_total, heads, dim, generator=gen, device=device).bfloat16() for _ in range(layers)]
    k_dst = [torch.zeros_like(b) for b in k_src]
    v_dst = [torch.zeros_like(b) for b in v_src]
    src_slots = torch.randperm(slots_total - 1, device=device)[:num_tokens] + 1
    dst_slots = torch.randperm(slots_total - 1, device=device)[:num_tokens] + 1
    packed = torch.empty(layers, 2, num_tokens, heads, dim, dtype=torch.bfloat16, device=device)
    reference = torch.empty_like(packed)
    gather_kv(k_src, v_src, src_slots, packed)
    gather_kv_torch(k_src, v_src, src_slots, reference)
    assert torch.equal(packed, reference)
    scatter_kv(k_dst, v_dst, dst_slots, packed)
    for layer in (0, 17, 31):
        assert torch.equal(k_dst[layer][dst_slots], k_src[layer][src_slots])
        assert torch.equal(v_dst[layer][dst_slots], v_src[layer][src_slots])
