"""Fused RMSNorm(+residual), rotary and SiLU-and-mul kernels vs the PyTorch layers they replace.

Without CUDA the kernels run under the Triton interpreter (small shapes); the references are
the CPU paths of `radixmesh.engine.models.layers`, so the two paths stay interchangeable.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.engine.models.layers import RMSNorm, RotaryEmbedding, _rotate
from radixmesh.kernels.fused import KVStoreTarget, apply_rotary_, rms_norm, silu_and_mul

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
# (atol, rtol): same rounding steps, so a few ulps of the activation dtype apart at most
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def _torch_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], eps)
    norm.weight.data = w.cpu()
    return norm(x.cpu())  # the CPU module takes the PyTorch path


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 96), (3, 576)])
def test_rms_norm_matches_torch(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    out, res = rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5)
    assert res is None
    torch.testing.assert_close(out.cpu().float(), _torch_norm(x, w, 1e-5).float(), atol=TOL[dtype][0],
                               rtol=TOL[dtype][1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_returns_the_sum_and_its_norm(dtype):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 128, generator=gen).to(dtype)
    residual = torch.randn(4, 128, generator=gen).to(dtype)
    w = torch.rand(128, generator=gen).to(dtype)
    out, summed = rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6, residual.to(DEVICE))
    assert summed is not None
    if DEVICE.type == "cuda":  # the sum rounds exactly as PyTorch's add
        assert torch.equal(summed.cpu(), x + residual)
    else:  # the interpreter truncates when it narrows to bf16: one ulp apart
        torch.testing.assert_close(summed.float(), (x + residual).float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
    torch.testing.assert_close(out.cpu().float(), _torch_norm(x + residual, w, 1e-6).float(),
                               atol=TOL[dtype][0], rtol=TOL[dtype][1])
    # the residual input is left as it was
    assert torch.equal(residual.to(DEVICE).cpu(), residual)


def test_rms_norm_strided_rows_and_bad_inputs():
    x = torch.randn(3, 256, device=DEVICE)[:, :128]  # row stride 256, contiguous last dim
    out, _ = rms_norm(x, torch.ones(128, device=DEVICE), 1e-5)
    torch.testing.assert_close(out.cpu(), _torch_norm(x.contiguous(), torch.ones(128), 1e-5), atol=1e-5,
                               rtol=1e-5)
    with pytest.raises(AssertionError, match="weight has shape"):
        rms_norm(torch.randn(2, 8, device=DEVICE), torch.ones(9, device=DEVICE), 1e-5)
    with pytest.raises(AssertionError, match="residual has dtype"):
        rms_norm(torch.randn(2, 8, device=DEVICE), torch.ones(8, device=DEVICE), 1e-5,
                 torch.randn(2, 8, device=DEVICE, dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (8, 2, 128), (9, 3, 64)])
def test_rotary_in_place_on_qkv_views_matches_torch(dtype, heads, kv_heads, head_dim):
    tokens = 6
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None)
    gen = torch.Generator().manual_seed(heads * head_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 2, 100, 7, 511])
    q_ref, k_ref, v_ref = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    cos = rotary.cos_cache[positions].unsqueeze(1)
    sin = rotary.sin_cache[positions].unsqueeze(1)
    want_q = _rotate(q_ref.reshape(tokens, heads, head_dim), cos, sin)
    want_k = _rotate(k_ref.reshape(tokens, kv_heads, head_dim), cos, sin)

    dev = qkv.to(DEVICE)
    q, k, v = dev.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    apply_rotary_(q, k, positions.to(DEVICE), rotary.cos_cache.to(DEVICE), rotary.sin_cache.to(DEVICE))
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(q.cpu().float(), want_q.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(k.cpu().float(), want_k.float(), atol=atol, rtol=rtol)
    assert torch.equal(v.cpu(), v_ref)  # v is untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_with_kv_store_writes_rotated_k_and_v_to_their_slots(dtype):
    tokens, heads, kv_heads, head_dim = 5, 6, 3, 64
    rotary = RotaryEmbedding(head_dim, 256, 10000.0, None)
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    positions = torch.tensor([3, 0, 255, 17, 4])
    loc = torch.tensor([9, 2, 5, 1, 7])
    _, k_ref, v_ref = qkv.split(sizes, -1)
    cos, sin = rotary.cos_cache[positions].unsqueeze(1), rotary.sin_cache[positions].unsqueeze(1)
    want_k = _rotate(k_ref.reshape(tokens, kv_heads, head_dim), cos, sin)

    dev = qkv.to(DEVICE)
    q, k, v = dev.split(sizes, -1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    k_buf = torch.full((12, kv_heads, head_dim), -7.0, dtype=dtype, device=DEVICE)
    v_buf = torch.full((12, kv_heads, head_dim), -7.0, dtype=dtype, device=DEVICE)
    apply_rotary_(q, k, positions.to(DEVICE), rotary.cos_cache.to(DEVICE), rotary.sin_cache.to(DEVICE),
                  KVStoreTarget(v, k_buf, v_buf, loc.to(DEVICE)))
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(k_buf[loc.to(DEVICE)].cpu().float(), want_k.float(), atol=atol, rtol=rtol)
    assert torch.equal(v_buf[loc.to(DEVICE)].cpu(), v_ref.reshape(tokens, kv_heads, head_dim))
    assert torch.equal(k_buf[loc.to(DEVICE)].cpu(), k.cpu())  # the pool holds exactly the rotated k
    untouched = [s for s in range(12) if s not in loc.tolist()]
    assert (k_buf[untouched] == -7).all() and (v_buf[untouched] == -7).all()
    with pytest.raises(AssertionError, match="loc has shape"):
        apply_rotary_(q, k, positions.to(DEVICE), rotary.cos_cache.to(DEVICE), rotary.sin_cache.to(DEVICE),
                      KVStoreTarget(v, k_buf, v_buf, loc[:3].to(DEVICE)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_with_qk_norm_normalizes_each_head_first(dtype):
    """Qwen3: RMSNorm of every q and k head (its own weights), then rotary and the KV store, in one launch; the
    reference is the model's PyTorch RMSNorm then rotary."""
    from radixmesh.engine.models.layers import RMSNorm
    from radixmesh.kernels.fused import QKNorm

    tokens, heads, kv_heads, head_dim = 4, 8, 2, 128
    rotary = RotaryEmbedding(head_dim, 256, 1000000.0, None)
    gen = torch.Generator().manual_seed(5)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(torch.rand(head_dim, generator=gen) + 0.5)
        k_norm.weight.copy_(torch.rand(head_dim, generator=gen) + 0.5)
    q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)
    positions, loc = torch.tensor([3, 0, 255, 17]), torch.tensor([1, 4, 2, 6])
    q_ref, k_ref, v_ref = (t.reshape(tokens, -1, head_dim) for t in qkv.split(sizes, -1))
    with torch.no_grad():
        want_q, want_k = rotary(positions, q_norm(q_ref), k_norm(k_ref))

    dev = qkv.to(DEVICE)
    q, k, v = (t.view(tokens, -1, head_dim) for t in dev.split(sizes, -1))
    k_buf = torch.zeros((8, kv_heads, head_dim), dtype=dtype, device=DEVICE)
    v_buf = torch.zeros((8, kv_heads, head_dim), dtype=dtype, device=DEVICE)
    apply_rotary_(q, k, positions.to(DEVICE), rotary.cos_cache.to(DEVICE), rotary.sin_cache.to(DEVICE),
                  KVStoreTarget(v, k_buf, v_buf, loc.to(DEVICE)),
                  QKNorm(q_norm.weight.detach().to(DEVICE), k_norm.weight.detach().to(DEVICE), 1e-6))
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(q.cpu().float(), want_q.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(k.cpu().float(), want_k.float(), atol=atol, rtol=rtol)
    assert torch.equal(k_buf[loc.to(DEVICE)].cpu(), k.cpu())
    assert torch.equal(v_buf[loc.to(DEVICE)].cpu(), v_ref)
    with pytest.raises(AssertionError, match="q_weight has shape"):
        apply_rotary_(q, k, positions.to(DEVICE), rotary.cos_cache.to(DEVICE), rotary.sin_cache.to(DEVICE),
                      qk_norm=QKNorm(q_norm.weight.detach()[:64].to(DEVICE), k_norm.weight.detach().to(DEVICE), 1e-6))


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (32, 4)])
def test_rotary_gives_the_same_bits_at_any_q_heads_per_program(heads, kv_heads):
    """q heads in blocks of 1, 2, 8 or all of them a program (the k heads and the store in one more): the same
    q, k and pool rows, with the Qwen3 norms and without."""
    from radixmesh.kernels.fused import QKNorm

    tokens, head_dim = 3, 64
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None)
    gen = torch.Generator().manual_seed(heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(torch.bfloat16)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    positions, loc = torch.tensor([5, 0, 63], device=DEVICE), torch.tensor([2, 0, 1], device=DEVICE)
    norm = QKNorm(*(torch.rand(head_dim, generator=gen).add(0.5).to(torch.bfloat16).to(DEVICE) for _ in range(2)),
                  1e-6)
    for qk_norm in (None, norm):
        results = []
        for per_program in (1, 2, 8, 64):
            q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.to(DEVICE, copy=True).split(sizes, -1))
            bufs = [torch.zeros((4, kv_heads, head_dim), dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
            apply_rotary_(q, k, positions, rotary.cos_cache.to(DEVICE), rotary.sin_cache.to(DEVICE),
                          KVStoreTarget(v, bufs[0], bufs[1], loc), qk_norm, q_heads_per_program=per_program)
            results.append([q.cpu(), k.cpu(), bufs[0].cpu(), bufs[1].cpu()])
        for other in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    with pytest.raises(AssertionError, match="must be a power of 2"):
        apply_rotary_(q, k, positions, rotary.cos_cache.to(DEVICE), rotary.sin_cache.to(DEVICE), q_heads_per_program=3)


def test_rotary_checks_its_inputs():
    q = torch.randn(2, 4, 64, device=DEVICE)
    k = torch.randn(2, 2, 64, device=DEVICE)
    cache = torch.randn(16, 32, device=DEVICE)
    with pytest.raises(AssertionError, match="positions has shape"):
        apply_rotary_(q, k, torch.zeros(3, dtype=torch.int64, device=DEVICE), cache, cache)
    with pytest.raises(AssertionError, match="cos_cache must be"):
        apply_rotary_(q, k, torch.zeros(2, dtype=torch.int64, device=DEVICE), cache[:, :16].contiguous(), cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 96), (3, 1536), (2, 1100)])
def test_silu_and_mul_matches_torch(dtype, rows, width):
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(rows, 2 * width, generator=gen) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = silu_and_mul(x.to(DEVICE)).cpu()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
    with pytest.raises(AssertionError, match="2 \\* width"):
        silu_and_mul(torch.randn(2, 7, device=DEVICE))
