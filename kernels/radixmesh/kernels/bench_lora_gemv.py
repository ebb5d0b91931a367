"""Case `layer-1` of `bench_lora`: one 8B layer's projections at batch 1 with an adapter, launched as a decode step
launches them, so a kernel set's cost includes the fusions it keeps or undoes.

Base (no adapter): the fused GEMVs of a batch-1 step: norm + q/k/v + rotary + KV store, o, norm + gate/up +
SiLU-and-mul, down. With an adapter, per kernel set:

    rows      the norm, the GEMV, the per-row shrink and expand, then the rotary store or SiLU-and-mul: the fusions
              undone (what an engine step ran before "epilogue")
    epilogue  one shrink launch (of the normed row where the GEMV runs the norm), the expand in the GEMV's epilogue
    grouped / fused   the adapter as an addend of the fused GEMVs (`lora_norm_delta`), o and down: the GEMV then
              `lora_apply` of that kernel set

`lora_us` is what the adapter adds (with_lora - base); `rel_err` (with --check) compares the output with a float32
reference and divides by the adapter's contribution (bf16 rounding of the whole output included).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixmesh.kernels._bench import time_us
from radixmesh.kernels.bench_gemv import L2_SPAN_BYTES
from radixmesh.kernels.fused import KVStoreTarget, apply_rotary_, rms_norm, silu_and_mul
from radixmesh.kernels.gemv import gemv
from radixmesh.kernels.gemv_fused import gemv_add_rmsnorm
from radixmesh.kernels.gemv_rope import RopeStore, gemv_add_rmsnorm_rope
from radixmesh.kernels.lora import LoraBatch, lora_apply
from radixmesh.kernels.lora_gemv import EPILOGUE_WIDTH, lora_gemv_shrink, shrink_tiles
from radixmesh.kernels.lora_prologue import lora_norm_delta
from radixmesh.kernels.lora_ref import lora_ref

EPS = 1e-5
HEADS = (32, 8, 128)
"""Llama-3.1-8B: q heads, kv heads, head_dim."""
LAYER = [("qkv", 4096, (4096, 1024, 1024), "rope"), ("o", 4096, (4096,), "plain"),
         ("gate_up", 4096, (14336, 14336), "gated"), ("down", 14336, (4096,), "plain")]
"""(name, in features, output slices, the base kernel) of one layer."""
POSITION, LOC = 37, 5


@dataclass
class Projection:
    """One projection's operands: weight and adapter copies (enough for a graph to stream them from memory)."""

    kind: str
    slices: tuple[int, ...]
    weights: list[torch.Tensor]
    adapters: list[tuple[torch.Tensor, torch.Tensor]]
    x: torch.Tensor
    residual: torch.Tensor
    norm_weight: torch.Tensor
    batch: LoraBatch
    ranks: torch.Tensor
    scalings: torch.Tensor
    rope: RopeStore | None


def make_projection(k: int, slices: tuple[int, ...], kind: str, rank: int, max_rank: int, device: str = "cuda",
                    heads: tuple[int, int, int] = HEADS, span_bytes: int = L2_SPAN_BYTES) -> Projection:
    """Random bf16 operands, copied until a pass over the copies reads `span_bytes`; `heads` (q heads, kv
    heads, head_dim) of a "rope" projection."""
    n, bf16 = sum(slices), torch.bfloat16

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device) * scale).to(bf16)

    weights = [rand(n, k, scale=0.02) for _ in range(max(2, math.ceil(span_bytes / (n * k * 2))))]
    adapter_bytes = (len(slices) * max_rank * k + n * max_rank) * 2
    adapters = [(rand(1, len(slices) * max_rank, k, scale=0.02), rand(1, n, max_rank, scale=0.02))
                for _ in range(max(2, math.ceil(span_bytes / adapter_bytes)))]
    rope = None
    if kind == "rope":
        hq, hkv, d = heads
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
        freqs = torch.outer(torch.arange(64, dtype=torch.float32, device=device), inv_freq)
        pools = [torch.zeros(16, hkv, d, device=device, dtype=bf16) for _ in range(2)]
        rope = RopeStore(torch.tensor([POSITION], device=device), freqs.cos(), freqs.sin(), pools[0], pools[1],
                         torch.tensor([LOC], device=device), hq, hkv, d)
    return Projection(kind, slices, weights, adapters, rand(1, k), rand(1, k), 1 + rand(k, scale=0.1),
                      LoraBatch.per_row(torch.zeros(1, dtype=torch.int32, device=device)),
                      torch.full((1,), rank, dtype=torch.int32, device=device),
                      torch.full((1,), 2.0, dtype=torch.float32, device=device), rope)


def launches(p: Projection, kernels: str | None, i: int = 0, width: int = EPILOGUE_WIDTH) -> Callable[[], torch.Tensor]:
    """The launches of copy `i` as a step runs them: the base kernels (`kernels` None) or with the adapter (the
    epilogue's shrink split for `width` partial sums a row)."""
    w = p.weights[i % len(p.weights)]
    a, b = p.adapters[i % len(p.adapters)]
    lora = (a, b, p.batch, p.ranks, p.scalings, p.slices)
    norm = (p.x, p.residual, p.norm_weight, EPS)

    def fused(**extra: object) -> torch.Tensor:
        if p.kind == "rope":
            assert p.rope is not None
            return gemv_add_rmsnorm_rope(*norm, w, None, p.rope, **extra)[0]  # type: ignore[arg-type]
        if p.kind == "gated":
            return gemv_add_rmsnorm(*norm, w, gated=True, **extra)[0]  # type: ignore[arg-type]
        return gemv(p.x, w, **extra)  # type: ignore[arg-type]

    def run() -> torch.Tensor:
        if kernels is None:
            return fused()
        if kernels == "epilogue":
            normed = p.kind != "plain"
            tiles = shrink_tiles(p.x.shape[-1], b.shape[2], cpu=p.x.device.type == "cpu", width=width)
            return fused(lora=lora_gemv_shrink(p.x, a, b, p.batch.slots, p.ranks, p.scalings, p.slices,
                                               residual=p.residual if normed else None,
                                               norm_weight=p.norm_weight if normed else None, tiles=tiles))
        if kernels in ("grouped", "fused") and p.kind != "plain":
            return fused(addend=lora_norm_delta(*norm, a, b, p.batch.slots, p.ranks, p.scalings, p.slices))
        return _unfused(p, w, lora, kernels)

    return run


def _unfused(p: Projection, w: torch.Tensor, lora: tuple, kernels: str) -> torch.Tensor:
    """The norm, the GEMV, `lora_apply`, then the rotary store or SiLU-and-mul, each its own launch."""
    h = p.x if p.kind == "plain" else rms_norm(p.x, p.norm_weight, EPS, p.residual)[0]
    a, b, batch, ranks, scalings, slices = lora
    y = lora_apply(h, gemv(h, w), a, b, batch, ranks, scalings, slices, kernels=kernels)
    if p.kind == "gated":
        return silu_and_mul(y)
    if p.kind == "rope":
        assert p.rope is not None
        hq, hkv, d = p.rope.num_q_heads, p.rope.num_kv_heads, p.rope.head_dim
        q, k, v = y.view(1, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
        rope = p.rope
        apply_rotary_(q, k, rope.positions, rope.cos_cache, rope.sin_cache,
                      KVStoreTarget(v, rope.k_buffer, rope.v_buffer, rope.loc))
    return y


def reference(p: Projection, with_lora: bool) -> torch.Tensor:
    """float32 output of copy 0: `h @ W.T` (+ the adapter of h), then the rotation or SiLU-and-mul."""
    x = p.x.float()
    if p.kind != "plain":
        summed = (p.x + p.residual).float()
        x = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + EPS) * p.norm_weight.float()
    y = x @ p.weights[0].float().t()
    if with_lora:
        a, b = p.adapters[0]
        y = lora_ref(x, y, a, b, [0], p.ranks.cpu(), p.scalings.cpu(), p.slices)
    if p.kind == "gated":
        gate, up = y.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    if p.kind == "rope":
        assert p.rope is not None
        hq, hkv, d = p.rope.num_q_heads, p.rope.num_kv_heads, p.rope.head_dim
        heads = y.view(hq + 2 * hkv, d).clone()
        lo, hi = heads[:hq + hkv, :d // 2].clone(), heads[:hq + hkv, d // 2:].clone()
        cos, sin = p.rope.cos_cache[POSITION], p.rope.sin_cache[POSITION]
        heads[:hq + hkv, :d // 2], heads[:hq + hkv, d // 2:] = lo * cos - hi * sin, hi * cos + lo * sin
        return heads.view(1, -1)
    return y


def bench_layer_one(name: str, k: int, slices: tuple[int, ...], kind: str, kernels: str, rank: int, max_rank: int,
                    with_check: bool, width: int = EPILOGUE_WIDTH) -> dict[str, object]:
    """One projection's row of case `layer-1` for a kernel set ("auto": what a step takes at one row, epilogue;
    `width`: the epilogue's partial sums a row, reported as `epilogue_width`)."""
    resolved = "epilogue" if kernels == "auto" else kernels
    p = make_projection(k, slices, kind, rank, max_rank)
    count = max(len(p.weights), len(p.adapters))
    base_us = time_us([launches(p, None, i) for i in range(count)])
    with_us = time_us([launches(p, resolved, i, width) for i in range(count)])
    row: dict[str, object] = {
        "bench": "lora", "case": "layer-1", "projection": name, "kernels": resolved, "rows": 1, "in": k,
        "slices": list(slices), "rank": rank, "max_rank": max_rank, "adapters": 1, "base_us": base_us,
        "with_lora_us": with_us,
        "lora_us": round(with_us - base_us, 2) if base_us is not None and with_us is not None else None}
    if base_us and with_us:
        row["base_share"] = round(base_us / with_us, 3)
    if resolved == "epilogue":
        row["epilogue_width"] = width
    if with_check:
        row["rel_err"] = check(p, resolved, width)
    return row


def check(p: Projection, kernels: str, width: int = EPILOGUE_WIDTH) -> float:
    """Error of the output with the adapter against the float32 reference, over the adapter's contribution."""
    want, plain = reference(p, True), reference(p, False)
    got = launches(p, kernels, 0, width)().float()
    return round(float((got - want).norm() / (want - plain).norm()), 5)
