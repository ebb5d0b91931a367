"""Fused RMSNorm(+residual), rotary and SiLU-and-mul kernels at real model shapes on a CUDA device.

The references are the PyTorch formulas of `radixmesh.engine.models.layers`, run on the same
device in float32 from the same inputs, compared by relative error (bf16 and fp16 activations).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # skipped then; keep the CPU tests' interpreter mode

import pytest

from radixmesh.engine.models.layers import rope_inv_freq

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any(), "NaN in the kernel's output"
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 2048), (7, 4096), (512, 4096), (33, 8192), (4096, 576)])
def test_rms_norm_residual_real_shapes(dtype, rows, hidden):
    from radixmesh.kernels.fused import rms_norm

    gen = torch.Generator(device=DEVICE).manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=gen, device=DEVICE).to(dtype)
    residual = (4 * torch.randn(rows, hidden, generator=gen, device=DEVICE)).to(dtype)
    w = (1 + 0.2 * torch.randn(hidden, generator=gen, device=DEVICE)).to(dtype)
    summed_ref = (x.float() + residual.float())
    want = w.float() * (summed_ref * torch.rsqrt(summed_ref.pow(2).mean(-1, keepdim=True) + 1e-5))
    for _ in range(2):  # a second run must not depend on the first's leftovers
        normed, summed = rms_norm(x, w, 1e-5, residual)
        assert summed is not None
        assert _rel_err(summed, summed_ref) < TOL[dtype]
        assert _rel_err(normed, want) < TOL[dtype]
    plain, none = rms_norm(x, w, 1e-5)
    assert none is None
    x32 = x.float()
    assert _rel_err(plain, w.float() * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 32, 8, 128), (300, 32, 8, 64), (64, 64, 8, 128),
                                                           (17, 28, 4, 128), (9, 32, 32, 128)])
def test_rotary_real_shapes_on_qkv_views(dtype, tokens, heads, kv_heads, head_dim):
    from radixmesh.kernels.fused import KVStoreTarget, apply_rotary_

    gen = torch.Generator(device=DEVICE).manual_seed(tokens * heads)
    inv_freq = rope_inv_freq(head_dim, 500000.0, None).to(DEVICE)
    t = torch.arange(8192, device=DEVICE, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen, device=DEVICE).to(dtype)
    positions = torch.randint(0, 8192, (tokens,), generator=gen, device=DEVICE)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]

    def rotate_ref(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    q_in, k_in, v_in = (p.clone() for p in qkv.split(sizes, -1))
    want_q = rotate_ref(q_in.view(tokens, heads, head_dim))
    want_k = rotate_ref(k_in.view(tokens, kv_heads, head_dim))
    q, k, v = qkv.split(sizes, -1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    apply_rotary_(q, k, positions, cos, sin)
    assert _rel_err(q, want_q) < TOL[dtype]
    assert _rel_err(k, want_k) < TOL[dtype]
    assert torch.equal(v, v_in)

    # the same launch with the KV store: the pool rows get exactly the rotated k and v
    q2, k2, v2 = (p.clone() for p in (q_in, k_in, v_in))
    q2, k2, v2 = (t.view(tokens, -1, head_dim) for t in (q2, k2, v2))
    num_slots = 4 * tokens + 1
    k_buf = torch.full((num_slots, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_buf = torch.full_like(k_buf, float("nan"))
    loc = torch.randperm(num_slots - 1, generator=gen, device=DEVICE)[:tokens] + 1
    apply_rotary_(q2, k2, positions, cos, sin, KVStoreTarget(v2, k_buf, v_buf, loc))
    assert torch.equal(q2, q) and torch.equal(k2, k)
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v_in.view(tokens, kv_heads, head_dim))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,width", [(1, 14336), (8, 8192), (1024, 1536), (3, 18944)])
def test_silu_and_mul_real_shapes(dtype, rows, width):
    from radixmesh.kernels.fused import silu_and_mul

    gen = torch.Generator(device=DEVICE).manual_seed(rows + width)
    x = (3 * torch.randn(rows, 2 * width, generator=gen, device=DEVICE)).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    assert _rel_err(silu_and_mul(x), want) < TOL[dtype]


def _num_variants(kernel) -> int:
    """Compiled variants of a Triton kernel on this device (its JIT cache)."""
    return sum(len(entry[0]) for entry in kernel.device_caches.values())


def test_staging_compiles_one_variant_for_any_row_count_and_slot_slice():
    """Row counts and slot-list slices change every step; none of them may bring a compilation."""
    from radixmesh.kernels.decode_inputs import _stage_decode_kernel, stage_decode_inputs

    padded, max_context = 32, 64
    req_to_token = torch.zeros(padded, max_context, dtype=torch.int32, device=DEVICE)
    free_slots = torch.arange(100, 200, dtype=torch.int64, device=DEVICE)
    prev = torch.arange(1000, 1000 + 48, dtype=torch.int64, device=DEVICE)
    counts = []
    for num_rows, offset, num_prev in [(16, 0, 48), (1, 1, 47), (17, 3, 33), (32, 5, 16), (7, 2, 1)]:
        input_ids = torch.full((padded,), -1, dtype=torch.int64, device=DEVICE)
        gather = torch.arange(num_rows, dtype=torch.int64, device=DEVICE)  # row i takes prev[i]
        slots_dst = torch.full((padded,), -1, dtype=torch.int64, device=DEVICE)
        rows = torch.arange(num_rows, dtype=torch.int64, device=DEVICE)
        positions = torch.full((num_rows,), 9, dtype=torch.int64, device=DEVICE)
        src = free_slots[offset:offset + num_rows]  # an unaligned slice for odd offsets
        stage_decode_inputs(input_ids, gather, prev[:num_prev], src, slots_dst, req_to_token, rows, positions)
        live = min(num_rows, num_prev)
        assert torch.equal(input_ids[:live], prev[:live])
        assert torch.equal(slots_dst[:num_rows], src) and not slots_dst[num_rows:].any()
        assert torch.equal(req_to_token[:num_rows, 9].long(), src)
        counts.append(_num_variants(_stage_decode_kernel))
        # the same rows with every id on the host (a step launched with nothing in flight): no variant of its own
        stage_decode_inputs(input_ids, None, None, src, slots_dst, req_to_token, rows, positions)
        counts.append(_num_variants(_stage_decode_kernel))
    assert counts[-1] == counts[0], f"variants compiled along the way: {counts}"
