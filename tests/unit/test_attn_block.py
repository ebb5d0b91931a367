"""The one-launch attention half of a decode token (`attn_block`) against a PyTorch reference of the same steps
(norm, q/k/v, Qwen3's q/k norms, rotary, KV store, attention over the request's slots, o), at tiny shapes (under
the Triton interpreter without CUDA: one program, so every grid barrier passes at once; on a GPU, the whole grid)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

from dataclasses import replace
from typing import NamedTuple

import pytest

from radixmesh.kernels.attn_block import (
    AttnBlockConfig,
    AttnBlockWorkspace,
    BlockRope,
    attn_block_decode,
    attn_block_supported,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6
SMALL = AttnBlockConfig(qkv_block_r=4, qkv_block_k=32, o_block_r=2, o_block_k=16, num_stages=1, num_splits=4,
                        block_n=16, num_warps=1, ctas_per_sm=1)
"""At H = 48: a ragged last K tile in the q/k/v phase."""
CONFIGS = {"four-splits": SMALL, "one-split": replace(SMALL, num_splits=1),
           "wide-tiles": replace(SMALL, qkv_block_r=8, qkv_block_k=16, o_block_r=8, o_block_k=64, num_stages=2)}
"""Four splits (a unit of one tile, splits past a short request empty), one split (a unit of up to four tiles),
other GEMV tiles (8 rows; q/k/v's K in three steps of 16, o's 64 in one)."""


class Layer(NamedTuple):
    x: torch.Tensor
    residual: torch.Tensor
    norm_weight: torch.Tensor
    w_qkv: torch.Tensor
    w_o: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def make_layer(hidden: int, heads: int, kv_heads: int, head_dim: int, slots: int, dtype: torch.dtype,
               seed: int = 0) -> Layer:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)

    positions = torch.arange(4096, dtype=torch.float32)[:, None]
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return Layer(rand(1, hidden), rand(1, hidden), 1 + rand(hidden, scale=0.1),
                 rand((heads + 2 * kv_heads) * head_dim, hidden, scale=hidden ** -0.5),
                 rand(hidden, heads * head_dim, scale=(heads * head_dim) ** -0.5), 1 + rand(head_dim, scale=0.1),
                 1 + rand(head_dim, scale=0.1), rand(slots, kv_heads, head_dim), rand(slots, kv_heads, head_dim),
                 torch.cos(positions * inv).to(DEVICE), torch.sin(positions * inv).to(DEVICE))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """`fused.rms_norm`'s rounding: the normed row in the dtype, then its product with the weight."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (w.float() * normed.float()).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([(x1 * cos - x2 * sin).to(x.dtype), (x2 * cos + x1 * sin).to(x.dtype)], dim=-1)


def reference(layer: Layer, heads: int, kv_heads: int, head_dim: int, pos: int, slot_ids: torch.Tensor,
              qk_norm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(out, summed, k_buf, v_buf)` step by step in PyTorch (float32 math, rounding where the model rounds)."""
    dtype = layer.x.dtype
    summed = (layer.x.float() + layer.residual.float()).to(dtype)
    h = _rms(summed, layer.norm_weight, EPS, dtype)
    qkv = (h.float() @ layer.w_qkv.float().T).to(dtype)[0]
    q = qkv[:heads * head_dim].view(heads, head_dim)
    k = qkv[heads * head_dim:(heads + kv_heads) * head_dim].view(kv_heads, head_dim)
    v = qkv[(heads + kv_heads) * head_dim:].view(kv_heads, head_dim)
    if qk_norm:
        q, k = _rms(q, layer.q_norm, EPS, dtype), _rms(k, layer.k_norm, EPS, dtype)
    cos, sin = layer.cos[pos], layer.sin[pos]
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    k_buf, v_buf = layer.k_buf.clone(), layer.v_buf.clone()
    k_buf[slot_ids[-1]], v_buf[slot_ids[-1]] = k, v
    keys, values = k_buf[slot_ids].float(), v_buf[slot_ids].float()  # [L, kv_heads, D]
    group = heads // kv_heads
    qg = q.float().view(kv_heads, group, head_dim)
    scores = torch.einsum("hgd,lhd->hgl", qg, keys) * head_dim ** -0.5
    attn = torch.einsum("hgl,lhd->hgd", scores.softmax(-1), values).reshape(1, heads * head_dim).to(dtype)
    out = (attn.float() @ layer.w_o.float().T).to(dtype)
    return out, summed, k_buf, v_buf


def run(layer: Layer, heads: int, kv_heads: int, head_dim: int, pos: int, slot_ids: torch.Tensor, qk_norm: bool,
        config: AttnBlockConfig, ws: AttnBlockWorkspace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    ws = ws or AttnBlockWorkspace.allocate(heads, kv_heads, head_dim, config.num_splits, layer.x.dtype, DEVICE)
    rope = BlockRope(layer.q_norm if qk_norm else None, layer.k_norm if qk_norm else None, EPS, layer.cos, layer.sin,
                     torch.tensor([pos], dtype=torch.int64, device=DEVICE), slot_ids[-1:].clone())
    # the request's slots sit after another request's in the index array: kv_indptr [start, end]
    other = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    indices = torch.cat([other, slot_ids])
    indptr = torch.tensor([3, 3 + slot_ids.numel()], dtype=torch.int32, device=DEVICE)
    out, summed = attn_block_decode(layer.x, layer.residual, layer.norm_weight, EPS, layer.w_qkv, layer.w_o, rope,
                                    layer.k_buf, layer.v_buf, indptr, indices, head_dim ** -0.5, ws, config=config)
    assert not ws.timed_out()
    assert ws.sync[:2].tolist() == [0, 0], "every launch leaves its counters at 0"
    return out, summed


@pytest.mark.parametrize("length", [1, 5, 16, 37, 64])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_block_matches_reference(length: int, qk_norm: bool, config: str) -> None:
    heads, kv_heads, head_dim, hidden, slots = 4, 2, 16, 48, 80
    dtype = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
    layer = make_layer(hidden, heads, kv_heads, head_dim, slots, dtype, seed=length)
    slot_ids = torch.randperm(slots, generator=torch.Generator().manual_seed(length))[:length].to(DEVICE)
    want_out, want_summed, want_k, want_v = reference(layer, heads, kv_heads, head_dim, length - 1, slot_ids, qk_norm)
    out, summed = run(layer, heads, kv_heads, head_dim, length - 1, slot_ids, qk_norm, CONFIGS[config])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(layer.k_buf, want_k, atol=tol, rtol=tol)  # the new token's row, the rest untouched
    torch.testing.assert_close(layer.v_buf, want_v, atol=tol, rtol=tol)
    torch.testing.assert_close(out, want_out, atol=tol, rtol=tol)


def test_workspace_is_shared_by_consecutive_layers() -> None:
    """Two layers in a row over one workspace: the second's results do not depend on the first's leftovers."""
    heads, kv_heads, head_dim, hidden, slots = 4, 1, 16, 32, 40
    dtype = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
    ws = AttnBlockWorkspace.allocate(heads, kv_heads, head_dim, SMALL.num_splits, dtype, DEVICE)
    slot_ids = torch.arange(20, device=DEVICE)
    results = []
    for seed in (1, 2):
        layer = make_layer(hidden, heads, kv_heads, head_dim, slots, dtype, seed=seed)
        results.append((run(layer, heads, kv_heads, head_dim, 19, slot_ids, True, SMALL, ws)[0],
                        reference(layer, heads, kv_heads, head_dim, 19, slot_ids, True)[0]))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in results:
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_supported_shapes() -> None:
    x = torch.zeros(1, 32, device=DEVICE)
    qkv = torch.zeros(6 * 16, 32, device=DEVICE)
    o = torch.zeros(32, 4 * 16, device=DEVICE)
    pool = torch.zeros(8, 1, 16, device=DEVICE)
    assert attn_block_supported(x, qkv, o, pool, 4, 1, 16)
    assert not attn_block_supported(torch.zeros(2, 32, device=DEVICE), qkv, o, pool, 4, 1, 16)  # two rows
    assert not attn_block_supported(x, qkv, o, pool.half(), 4, 1, 16)  # a pool of another dtype (e.g. FP8)
    assert not attn_block_supported(x, qkv[:-16], o, pool, 4, 1, 16)  # a q/k/v weight of the wrong rows
    assert not attn_block_supported(x, torch.zeros(6 * 12, 32, device=DEVICE), torch.zeros(32, 48, device=DEVICE),
                                    torch.zeros(8, 1, 12, device=DEVICE), 4, 1, 12)  # head_dim not a power of 2


def test_config_checks() -> None:
    with pytest.raises(AssertionError, match="power of 2"):
        AttnBlockConfig(qkv_block_r=3)
    with pytest.raises(AssertionError, match="block_n"):
        AttnBlockConfig(block_n=8)
