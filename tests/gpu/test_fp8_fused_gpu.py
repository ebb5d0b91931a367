"""FP8 on a GPU, the parts of issue 50: the RMSNorm and SiLU-and-mul kernels that quantize their own output, at
the 8B shape's widths and in a model (against the unfused launches); decode attention over an FP8 pool with
each widening and the FP8 tiles, at the offline run's batch, against the reference."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # skipped then; keep the CPU tests' interpreter mode

import pytest

from radixmesh.engine.quant.accuracy import checkpoint_weights, prefill_logits, random_prompts
from radixmesh.kernels.bench_decode import SWEEP_TILES_FP8
from radixmesh.kernels.decode_attention import FP8_WIDENS, decode_attention_fwd
from radixmesh.kernels.fp8_fused import rms_norm_quant, silu_and_mul_quant
from radixmesh.kernels.fp8_quant import quantize_rows
from radixmesh.kernels.fused import rms_norm, silu_and_mul
from radixmesh.kernels.reference import attention_reference

from .test_fp8_gpu import GPU_CONFIG, _runner, _ulp_mismatch

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")


@pytest.mark.parametrize("rows", [2, 7, 300, 4096])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_quant_at_the_8b_width(rows: int, with_residual: bool) -> None:
    x = torch.randn(rows, 4096, device=DEVICE, dtype=torch.bfloat16) * 2
    residual = torch.randn_like(x) if with_residual else None
    weight = 1 + torch.randn(4096, device=DEVICE, dtype=torch.bfloat16) * 0.1
    q, s, summed = rms_norm_quant(x, weight, 1e-5, residual)
    normed, summed_ref = rms_norm(x, weight, 1e-5, residual)
    q_ref, s_ref = quantize_rows(normed)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert _ulp_mismatch(q, q_ref) <= 1e-4
    if with_residual:
        assert summed is not None and summed_ref is not None and torch.equal(summed, summed_ref)


@pytest.mark.parametrize("rows", [2, 100, 2048])
@pytest.mark.parametrize("width", [14336, 7168])  # 8B, and its TP 2 shard
def test_silu_and_mul_quant_at_the_8b_width(rows: int, width: int) -> None:
    x = torch.randn(rows, 2 * width, device=DEVICE, dtype=torch.bfloat16) * 3
    q, s = silu_and_mul_quant(x)
    q_ref, s_ref = quantize_rows(silu_and_mul(x))
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert _ulp_mismatch(q, q_ref) <= 1e-4


def test_a_model_with_fused_quantization_gives_the_unfused_logits() -> None:
    """The same FP8 weights with the quantization inside the norm and SiLU kernels and in launches of its own."""
    prompts = random_prompts(24, GPU_CONFIG["vocab_size"], 4, 200, seed=3)
    fused = _runner(disable_cuda_graph=True, quantization="fp8", kv_cache_dtype="fp8_e4m3")
    unfused = _runner(disable_cuda_graph=True, quantization="fp8", kv_cache_dtype="fp8_e4m3",
                      disable_fp8_quant_fusion=True)
    assert fused.quant is not None and fused.quant.fuse_quant and unfused.quant is not None
    assert not unfused.quant.fuse_quant
    for (name, a), (_, b) in zip(checkpoint_weights(fused.model), checkpoint_weights(unfused.model)):
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b), f"dummy weights differ: {name}"
    got, want = prefill_logits(fused, prompts), prefill_logits(unfused, prompts)
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert float(cos.min()) > 0.9999, cos.min()
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.95


@pytest.mark.parametrize("widen", FP8_WIDENS)
@pytest.mark.parametrize("tiles", [None, *SWEEP_TILES_FP8[1:]])
def test_fp8_decode_widenings_and_tiles_at_the_offline_batch(widen: str, tiles: tuple[int, int, int] | None) -> None:
    batch, heads, kv_heads, head_dim = 168, 32, 8, 128
    gen = torch.Generator().manual_seed(1)
    seq_lens = torch.randint(256, 6145, (batch,), generator=gen).tolist()
    num_slots = sum(seq_lens) + 1
    k_scale, v_scale = 0.5, 2.0
    k_buf = (torch.randn(num_slots, kv_heads, head_dim, device=DEVICE) / k_scale).to(torch.float8_e4m3fn)
    v_buf = (torch.randn(num_slots, kv_heads, head_dim, device=DEVICE) / v_scale).to(torch.float8_e4m3fn)
    kv_indices = torch.randperm(num_slots - 1, device=DEVICE) + 1
    kv_indptr = torch.tensor([0, *seq_lens], device=DEVICE).cumsum(0)
    q = torch.randn(batch, heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    decode_attention_fwd(q, k_buf, v_buf, out, kv_indptr, kv_indices, head_dim**-0.5, 2, k_scale=k_scale,
                         v_scale=v_scale, tiles=tiles, fp8_widen=widen)
    want = attention_reference(q, k_buf.float() * k_scale, v_buf.float() * v_scale, list(range(batch + 1)),
                               kv_indptr.tolist(), kv_indices, head_dim**-0.5)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
