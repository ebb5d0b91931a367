"""FP8 kernels vs their PyTorch references (`radixmesh.kernels.fp8_ref`), at small shapes.

Without CUDA the kernels run on CPU under the Triton interpreter, which handles float8 loads, stores,
casts and `tl.dot`; the same tests run compiled on a GPU (`scripts/gpu_suite.sh`, stage fp8-tests).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.engine.models.layers import RotaryEmbedding, _rotate
from radixmesh.kernels.decode_attention import decode_attention_fwd
from radixmesh.kernels.extend_attention import extend_attention_fwd
from radixmesh.kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm
from radixmesh.kernels.fp8_quant import quantize_rows
from radixmesh.kernels.fp8_ref import (
    dequantize_rows,
    fp8_gemv_reference,
    fp8_limit,
    quantize_scaled,
)
from radixmesh.kernels.fp8_ref import (
    quantize_rows as quantize_rows_ref,
)
from radixmesh.kernels.fused import KVStoreTarget, apply_rotary_
from radixmesh.kernels.gemv import GemvConfig, gemv_fp8
from radixmesh.kernels.kv_store import build_kv_indices, store_kv
from radixmesh.kernels.kv_transfer import gather_kv, scatter_kv
from radixmesh.kernels.kv_transfer_ref import gather_kv_torch, scatter_kv_torch
from radixmesh.kernels.reference import attention_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu()


def _rand(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---- per-token activation quantization ------------------------------------------------------------

@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype,k", [(torch.float32, 96), (torch.bfloat16, 200), (torch.float16, 33)])
def test_quantize_rows_kernel_is_bit_exact(fp8: torch.dtype, dtype: torch.dtype, k: int) -> None:
    x = _rand(7, k, seed=k, scale=3.0).to(dtype)
    x[2] = 0  # an all-zero row: scale floor, zeros out
    x[4, 5] = 1e4  # an outlier: its row's scale follows it
    q, s = quantize_rows(x.to(DEVICE), fp8)
    q_ref, s_ref = quantize_rows_ref(x, fp8)
    assert q.dtype == fp8 and s.dtype == torch.float32
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(_bits(q), _bits(q_ref))
    assert float(q[4].float().abs().max()) == fp8_limit(fp8)  # each row spans the full range
    # within half an ulp: 2**-4 (e4m3) or 2**-3 (e5m2) relative, or half the subnormal spacing of the row
    rel, sub = (2**-4, 2**-10) if fp8 == E4M3 else (2**-3, 2**-17)
    err = (dequantize_rows(q_ref, s_ref, torch.float32) - x.float()).abs()
    assert bool((err <= torch.maximum(x.float().abs() * rel, s_ref[:, None] * sub) * 1.0001).all())


def test_quantize_rows_checks_its_inputs() -> None:
    with pytest.raises(AssertionError, match=r"must be \[M, K\]"):
        quantize_rows(torch.randn(4).to(DEVICE))
    with pytest.raises(AssertionError, match="expected one of"):
        quantize_rows(torch.randn(2, 8).to(DEVICE), torch.bfloat16)


# ---- FP8 GEMM ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("m,n,k", [(5, 40, 96), (17, 64, 80), (1, 33, 64)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemm_matches_float32_product_of_its_operands(m: int, n: int, k: int, out_dtype: torch.dtype) -> None:
    a, a_s = quantize_rows_ref(_rand(m, k, seed=1))
    w, w_s = quantize_rows_ref(_rand(n, k, seed=2, scale=0.05))
    want = (a.float() @ w.float().t()) * a_s[:, None] * w_s[None, :]
    got = fp8_gemm(a.to(DEVICE), a_s.to(DEVICE), w.to(DEVICE), w_s.to(DEVICE), out_dtype,
                   config=Fp8GemmConfig(16, 32, 32, 2, 1, 1) if DEVICE.type == "cpu" else None)
    assert got.shape == (m, n) and got.dtype == out_dtype
    # float32 output: exact sums in the interpreter; an H100's FP8 tensor cores add their products in fewer bits
    # than float32 (the kernel leaves Triton's fast accumulation on), 2.2e-4 of the largest output measured
    tol = 1e-2 if out_dtype != torch.float32 else 1e-5 if DEVICE.type == "cpu" else 2**-10
    torch.testing.assert_close(got.float().cpu(), want, atol=tol * float(want.abs().max()), rtol=tol)


def test_fp8_gemm_checks_its_inputs() -> None:
    a, a_s = quantize_rows_ref(_rand(4, 32))
    w, w_s = quantize_rows_ref(_rand(16, 32))
    a, a_s, w, w_s = a.to(DEVICE), a_s.to(DEVICE), w.to(DEVICE), w_s.to(DEVICE)
    with pytest.raises(AssertionError, match="features"):
        fp8_gemm(a[:, :16], a_s, w, w_s)
    with pytest.raises(AssertionError, match="w_scale must be"):
        fp8_gemm(a, a_s, w, w_s[:3])
    with pytest.raises(AssertionError, match="expected one of"):
        fp8_gemm(a.float(), a_s, w, w_s)
    with pytest.raises(AssertionError, match="a is"):
        fp8_gemm(a.float().to(E5M2), a_s, w, w_s)


# ---- FP8 GEMV ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k,config", [(64, 256, GemvConfig(8, 64)), (70, 200, GemvConfig(16, 64)), (5, 1000, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_fp8_matches_reference(n: int, k: int, config: GemvConfig | None, dtype: torch.dtype) -> None:
    x = _rand(1, k, seed=n).to(dtype)
    w, w_s = quantize_rows_ref(_rand(n, k, seed=k, scale=0.05))
    want = fp8_gemv_reference(x, w, w_s).float()
    got = gemv_fp8(x.to(DEVICE), w.to(DEVICE), w_s.to(DEVICE), config=config)
    assert got.shape == (1, n) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert float((got.float().cpu() - want).norm() / want.norm()) < tol
    flat = gemv_fp8(x[0].to(DEVICE), w.to(DEVICE), w_s.to(DEVICE), config=config)
    assert flat.shape == (n,) and torch.equal(flat.cpu(), got[0].cpu())
    with pytest.raises(AssertionError, match="weight_scale must be"):
        gemv_fp8(x.to(DEVICE), w.to(DEVICE), w_s[:2].to(DEVICE))


# ---- FP8 KV pool: stores --------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_store_kv_quantizes_through_the_scales(fp8: torch.dtype) -> None:
    kv_heads, head_dim, n = 3, 16, 5
    fused = _rand(n, 2, kv_heads, head_dim, seed=3, scale=4.0).to(torch.bfloat16)
    k, v = fused[:, 0], fused[:, 1]  # strided views, as slices of a fused projection
    k[0, 0, 0] = 1e5  # saturates instead of overflowing to NaN
    loc = torch.tensor([7, 1, 11, 4, 2])
    k_buf = torch.zeros(12, kv_heads, head_dim, dtype=fp8, device=DEVICE)
    v_buf = torch.zeros_like(k_buf)
    store_kv(k_buf, v_buf, loc.to(DEVICE), k.to(DEVICE), v.to(DEVICE), k_scale=0.5, v_scale=2.0)
    assert torch.equal(_bits(k_buf[loc.to(DEVICE)]), _bits(quantize_scaled(k, 1 / 0.5, fp8)))
    assert torch.equal(_bits(v_buf[loc.to(DEVICE)]), _bits(quantize_scaled(v, 1 / 2.0, fp8)))
    assert float(k_buf.float().abs().max()) == fp8_limit(fp8)
    assert int(_bits(k_buf[[0, 3, 5]]).count_nonzero()) == 0  # other slots untouched


def test_rotary_store_into_fp8_pool_matches_rotate_then_quantize() -> None:
    tokens, heads, kv_heads, head_dim = 4, 4, 2, 32
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None)
    qkv = _rand(tokens, (heads + 2 * kv_heads) * head_dim, seed=5, scale=2.0).to(torch.bfloat16)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    positions, loc = torch.tensor([3, 0, 63, 17]), torch.tensor([9, 2, 5, 1])
    _, k_ref, v_ref = qkv.split(sizes, -1)
    cos, sin = rotary.cos_cache[positions].unsqueeze(1), rotary.sin_cache[positions].unsqueeze(1)
    want_k = _rotate(k_ref.reshape(tokens, kv_heads, head_dim), cos, sin)
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.to(DEVICE).split(sizes, -1))
    k_buf = torch.zeros(12, kv_heads, head_dim, dtype=E4M3, device=DEVICE)
    v_buf = torch.zeros_like(k_buf)
    apply_rotary_(q, k, positions.to(DEVICE), rotary.cos_cache.to(DEVICE), rotary.sin_cache.to(DEVICE),
                  KVStoreTarget(v, k_buf, v_buf, loc.to(DEVICE), k_scale=0.25, v_scale=1.0))
    torch.testing.assert_close(k.cpu().float(), want_k.float(), atol=2e-2, rtol=2e-2)
    # the pool holds exactly the rotated (bf16) k, quantized: the same rounding as the reference path
    assert torch.equal(_bits(k_buf[loc.to(DEVICE)]), _bits(quantize_scaled(k.cpu(), 4.0, E4M3)))
    assert torch.equal(_bits(v_buf[loc.to(DEVICE)]), _bits(quantize_scaled(v_ref.reshape(tokens, kv_heads,
                                                                                           head_dim), 1.0, E4M3)))


# ---- FP8 KV pool: attention ---------------------------------------------------------------------------

def _fp8_pool(num_slots: int, kv_heads: int, head_dim: int, fp8: torch.dtype, k_scale: float, v_scale: float,
              seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_buf, v_buf) in FP8 and what they stand for in float32 (`fp8 * scale`)."""
    k = quantize_scaled(_rand(num_slots, kv_heads, head_dim, seed=seed, scale=2.0), 1 / k_scale, fp8)
    v = quantize_scaled(_rand(num_slots, kv_heads, head_dim, seed=seed + 1), 1 / v_scale, fp8)
    return k, v, k.float() * k_scale, v.float() * v_scale


def _indices(seq_lens: list[int], num_slots: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    req_to_token = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.int64)
    slots = torch.randperm(num_slots - 1, generator=gen) + 1
    start = 0
    for row, n in enumerate(seq_lens):
        req_to_token[row, :n] = slots[start:start + n]
        start += n
    return build_kv_indices(req_to_token.to(DEVICE), torch.arange(len(seq_lens), device=DEVICE),
                            torch.tensor(seq_lens, device=DEVICE), sum(seq_lens))


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_splits", [3, 1])
def test_decode_reads_fp8_pool_through_its_scales(fp8: torch.dtype, q_dtype: torch.dtype, num_kv_splits: int) -> None:
    seq_lens, heads, kv_heads, head_dim = [1, 37, 90], 8, 2, 32
    k_buf, v_buf, k_ref, v_ref = _fp8_pool(sum(seq_lens) + 1, kv_heads, head_dim, fp8, 0.5, 3.0, seed=7)
    kv_indptr, kv_indices = _indices(seq_lens, sum(seq_lens) + 1, seed=7)
    q = _rand(len(seq_lens), heads, head_dim, seed=8).to(q_dtype)
    out = torch.empty(q.shape, dtype=q_dtype, device=DEVICE)
    decode_attention_fwd(q.to(DEVICE), k_buf.to(DEVICE), v_buf.to(DEVICE), out, kv_indptr, kv_indices, 0.2,
                         num_kv_splits, k_scale=0.5, v_scale=3.0)
    want = attention_reference(q, k_ref, v_ref, list(range(len(seq_lens) + 1)), kv_indptr.tolist(),
                               kv_indices.cpu(), 0.2)
    tol = 2e-5 if q_dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float().cpu(), want, atol=tol * 3, rtol=tol)


@pytest.mark.parametrize("widen,tiles", [("direct", None), ("f16", None), ("f16", (128, 4, 3)), ("f32", (128, 8, 3))])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_decode_fp8_widening_and_tiles_match_the_reference(widen: str, tiles: tuple[int, int, int] | None,
                                                            q_dtype: torch.dtype) -> None:
    seq_lens, heads, kv_heads, head_dim = [5, 300, 129], 8, 2, 32
    k_buf, v_buf, k_ref, v_ref = _fp8_pool(sum(seq_lens) + 1, kv_heads, head_dim, E4M3, 0.5, 3.0, seed=11)
    kv_indptr, kv_indices = _indices(seq_lens, sum(seq_lens) + 1, seed=11)
    q = _rand(len(seq_lens), heads, head_dim, seed=12).to(q_dtype)
    q[1, 0, 0] = 1e6  # beyond float16: saturated on the f16 path, so that head attends to its largest key
    want = attention_reference(q, k_ref, v_ref, list(range(len(seq_lens) + 1)), kv_indptr.tolist(),
                               kv_indices.cpu(), 0.2)
    for num_kv_splits in (1, 3):
        out = torch.empty(q.shape, dtype=q_dtype, device=DEVICE)
        decode_attention_fwd(q.to(DEVICE), k_buf.to(DEVICE), v_buf.to(DEVICE), out, kv_indptr, kv_indices, 0.2,
                             num_kv_splits, k_scale=0.5, v_scale=3.0, tiles=tiles, fp8_widen=widen)
        tol = 2e-5 if q_dtype == torch.float32 and widen != "f16" else 3e-2
        got = out.float().cpu()
        torch.testing.assert_close(got[:, 1:], want[:, 1:], atol=tol * 3, rtol=tol)  # heads without the outlier
        torch.testing.assert_close(got[[0, 2]], want[[0, 2]], atol=tol * 3, rtol=tol)
        assert torch.isfinite(got).all()


def test_decode_rejects_an_unknown_widening() -> None:
    k_buf, v_buf, _, _ = _fp8_pool(9, 1, 16, E4M3, 1.0, 1.0, seed=1)
    kv_indptr, kv_indices = _indices([8], 9, seed=1)
    q = torch.zeros(1, 1, 16, device=DEVICE)
    with pytest.raises(AssertionError, match="fp8_widen"):
        decode_attention_fwd(q, k_buf.to(DEVICE), v_buf.to(DEVICE), torch.empty_like(q), kv_indptr, kv_indices, 1.0,
                             1, fp8_widen="e5m2")


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_extend_reads_fp8_pool_through_its_scales(q_dtype: torch.dtype) -> None:
    prefix_lens, new_lens, heads, kv_heads, head_dim = [20, 0], [9, 17], 4, 2, 32
    seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
    k_buf, v_buf, k_ref, v_ref = _fp8_pool(sum(seq_lens) + 1, kv_heads, head_dim, E4M3, 2.0, 0.5, seed=9)
    kv_indptr, kv_indices = _indices(seq_lens, sum(seq_lens) + 1, seed=9)
    q = _rand(sum(new_lens), heads, head_dim, seed=10).to(q_dtype)
    qo_indptr = [0, new_lens[0], sum(new_lens)]
    out = torch.empty(q.shape, dtype=q_dtype, device=DEVICE)
    extend_attention_fwd(q.to(DEVICE), k_buf.to(DEVICE), v_buf.to(DEVICE), out, torch.tensor(qo_indptr, device=DEVICE),
                         kv_indptr, kv_indices, max(new_lens), 0.3, k_scale=2.0, v_scale=0.5)
    want = attention_reference(q, k_ref, v_ref, qo_indptr, kv_indptr.tolist(), kv_indices.cpu(), 0.3)
    tol = 2e-5 if q_dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float().cpu(), want, atol=tol * 3, rtol=tol)


# ---- FP8 KV pool: transfer ----------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_kv_transfer_moves_fp8_bits(impl: str) -> None:
    layers, kv_heads, head_dim = 3, 2, 8

    def pool(seed: int, slots: int) -> list[torch.Tensor]:
        return [quantize_scaled(_rand(slots, kv_heads, head_dim, seed=seed + i, scale=50.0), 1.0, E4M3).to(DEVICE)
                for i in range(layers)]

    src_k, src_v, dst_k, dst_v = pool(0, 20), pool(10, 20), pool(20, 30), pool(30, 30)
    gather, scatter = (gather_kv, scatter_kv) if impl == "triton" else (gather_kv_torch, scatter_kv_torch)
    src_slots, dst_slots = torch.tensor([5, 19, 1, 7]), torch.tensor([29, 3, 11, 2], dtype=torch.int32)
    packed = torch.empty(layers - 1, 2, 4, kv_heads, head_dim, dtype=E4M3, device=DEVICE)
    gather(src_k, src_v, src_slots.to(DEVICE), packed, layer_begin=1)
    scatter(dst_k, dst_v, dst_slots.to(DEVICE), packed, layer_begin=1)
    for layer in (1, 2):
        assert torch.equal(_bits(dst_k[layer][dst_slots.long().to(DEVICE)]), _bits(src_k[layer][src_slots.to(DEVICE)]))
        assert torch.equal(_bits(dst_v[layer][dst_slots.long().to(DEVICE)]), _bits(src_v[layer][src_slots.to(DEVICE)]))
    assert torch.equal(_bits(dst_k[0]), _bits(pool(20, 30)[0]))  # layers outside the range untouched
    with pytest.raises(AssertionError, match="KV moves bit for bit"):
        gather(src_k, src_v, src_slots.to(DEVICE), packed.float())
