"""The batch-1 GEMV and the fused kernels at the shapes of tensor-parallel shards.

A rank's stacked q/k/v holds its own heads (3 query + 1 KV head of the default model at TP 3;
16 + 4 of the 8B at TP 2), its MLP and LM head a fraction of their rows or columns: widths that
are no longer powers of two or the tuned shapes. Under the Triton interpreter without CUDA
(the default model's shards); on a GPU also the 8B's.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.engine.distributed.layout import ShardLayout
from radixmesh.engine.loader.dummy import named_shape_config
from radixmesh.engine.models.layers import RotaryEmbedding, _rotate
from radixmesh.kernels.fused import KVStoreTarget, apply_rotary_, silu_and_mul
from radixmesh.kernels.gemv import gemv

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SHARDS = [("smollm2-135m", 3)] + ([("llama-3.1-8b", 2)] if DEVICE.type == "cuda" else [])


def _layer_shapes(shape: str, tp_size: int) -> list[tuple[str, int, int]]:
    """(layer, N, K) of rank 0's linear layers."""
    config = named_shape_config(shape)
    lo = ShardLayout.of(config, 0, tp_size)
    d, hidden = config.head_dim, config.hidden_size
    shapes = [("qkv", (lo.num_heads + 2 * lo.num_kv_heads) * d, hidden), ("o", hidden, lo.num_heads * d),
              ("gate_up", 2 * lo.intermediate_size, hidden), ("down", hidden, lo.intermediate_size)]
    if DEVICE.type == "cuda":
        shapes.append(("lm_head", lo.vocab_rows, hidden))
    return shapes


@pytest.mark.parametrize(("shape", "tp_size"), SHARDS)
def test_gemv_on_every_linear_shard(shape: str, tp_size: int) -> None:
    for name, n, k in _layer_shapes(shape, tp_size):
        gen = torch.Generator().manual_seed(n + k)
        x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
        want = x.float() @ w.float().t()
        got = gemv(x.to(DEVICE), w.to(DEVICE)).cpu().float()
        assert float((got - want).norm() / want.norm()) < 1e-2, f"{shape} TP {tp_size}: {name} [{n}, {k}]"


@pytest.mark.parametrize(("shape", "tp_size"), SHARDS)
def test_rotary_and_kv_store_on_a_ranks_heads(shape: str, tp_size: int) -> None:
    config = named_shape_config(shape)
    lo = ShardLayout.of(config, tp_size - 1, tp_size)
    heads, kv_heads, d = lo.num_heads, lo.num_kv_heads, config.head_dim
    tokens = 3
    rotary = RotaryEmbedding(d, 64, config.rope_theta, None)
    gen = torch.Generator().manual_seed(heads)
    sizes = [heads * d, kv_heads * d, kv_heads * d]
    qkv = torch.randn(tokens, sum(sizes), generator=gen)  # the rank's stacked projection output
    positions, loc = torch.tensor([0, 5, 63]), torch.tensor([4, 1, 2])
    cos, sin = rotary.cos_cache[positions].unsqueeze(1), rotary.sin_cache[positions].unsqueeze(1)
    q_ref, k_ref, v_ref = (t.reshape(tokens, -1, d).clone() for t in qkv.split(sizes, -1))
    q, k, v = (t.view(tokens, -1, d) for t in qkv.to(DEVICE).split(sizes, -1))  # views: rotated in place
    k_buf = torch.zeros(6, kv_heads, d, device=DEVICE)
    v_buf = torch.zeros(6, kv_heads, d, device=DEVICE)
    apply_rotary_(q, k, positions.to(DEVICE), rotary.cos_cache.to(DEVICE), rotary.sin_cache.to(DEVICE),
                  KVStoreTarget(v, k_buf, v_buf, loc.to(DEVICE)))
    torch.testing.assert_close(q.cpu(), _rotate(q_ref, cos, sin), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_buf[loc.to(DEVICE)].cpu(), _rotate(k_ref, cos, sin), atol=1e-5, rtol=1e-5)
    assert torch.equal(v_buf[loc.to(DEVICE)].cpu(), v_ref)


@pytest.mark.parametrize(("shape", "tp_size"), SHARDS)
def test_silu_and_mul_on_a_ranks_mlp_width(shape: str, tp_size: int) -> None:
    width = ShardLayout.of(named_shape_config(shape), 0, tp_size).intermediate_size
    x = torch.randn(2, 2 * width, generator=torch.Generator().manual_seed(width)) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(x.to(DEVICE)).cpu(), torch.nn.functional.silu(gate) * up,
                               atol=1e-5, rtol=1e-5)
