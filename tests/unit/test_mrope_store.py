"""M-RoPE's fused rotary + KV store (the CUDA path of Qwen2-VL layers), run here under the Triton
interpreter: both position layouts write what rotating and storing separately writes, into bf16 and FP8
pools (with their scales), and leave q and k rotated in place."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.models.qwen2_vl import MRotaryEmbedding


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("mrope", [False, True])
def test_forward_store_matches_rotate_then_store(pool_dtype: torch.dtype, mrope: bool) -> None:
    torch.manual_seed(0)
    rotary = MRotaryEmbedding(16, 64, 10000.0, (2, 3, 3))
    tokens, heads, kv_heads = 5, 4, 2
    positions = torch.randint(0, 64, (3, tokens) if mrope else (tokens,))
    q, k, v = torch.randn(tokens, heads, 16), torch.randn(tokens, kv_heads, 16), torch.randn(tokens, kv_heads, 16)
    loc = torch.tensor([3, 7, 1, 9, 4])
    k_scale, v_scale = (1.0, 1.0) if pool_dtype == torch.float32 else (0.5, 2.0)
    k_buf, v_buf = torch.zeros(12, kv_heads, 16, dtype=pool_dtype), torch.zeros(12, kv_heads, 16, dtype=pool_dtype)
    q_ref, k_ref = rotary(positions, q.clone(), k.clone())
    rotary.forward_store(positions, q, k, v, k_buf, v_buf, loc, k_scale, v_scale)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    # q and k rotated in place: attention may read the new tokens' k there instead of from the pool
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
    tol = 1e-5 if pool_dtype == torch.float32 else 0.13  # e4m3 keeps 3 mantissa bits
    torch.testing.assert_close(k_buf[loc].float() * k_scale, k_ref, atol=tol * 4, rtol=tol)
    torch.testing.assert_close(v_buf[loc].float() * v_scale, v, atol=tol * 4, rtol=tol)
