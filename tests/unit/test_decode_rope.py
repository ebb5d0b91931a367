"""Decode attention with the rotary work fused in (`decode_attention_fwd(..., rope=DecodeRope(...))`) against the
two launches it replaces, `apply_rotary_` with its KV store and q/k norms, then `decode_attention_fwd`: the same
bits in the output and in the pool, at lengths that put the new token at every kind of split position."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.models.layers import RotaryEmbedding
from radixmesh.kernels.decode_attention import DecodeScratch, decode_attention_fwd
from radixmesh.kernels.decode_rope import DecodeRope
from radixmesh.kernels.fused import KVStoreTarget, QKNorm, apply_rotary_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn
MAX_POSITIONS = 8192  # (the GPU test's lengths reach 4096)
# BLOCK_N is 64 here: 2 splits of 128 tokens are 64 each, the new token last in the last one; of 129 tokens, 128
# and 1, the new token alone in the second; 3 splits of a 5-token request leave two splits empty
LENGTH_CASES = {"one-token": ([1], 1), "short": ([5], 1), "split-boundary": ([128], 2), "last-split": ([129], 2),
                "more-splits-than-tokens": ([5], 3), "batch-3": ([1, 70, 200], 3), "batch-2-direct": ([9, 64], 1)}


class Step:
    """One decode step's inputs: a raw qkv projection, q/k norms, a KV pool with every request's past tokens and
    the new token's slot (the last of its request's slots, as the engine allocates them)."""

    def __init__(self, seq_lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 pool_dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        batch, self.heads, self.kv_heads, self.head_dim = len(seq_lens), heads, kv_heads, head_dim
        self.sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        self.qkv = (torch.randn(batch, sum(self.sizes), generator=gen) * 2).to(dtype).to(DEVICE)
        self.q_norm, self.k_norm = (torch.rand(head_dim, generator=gen).add(0.5).to(dtype).to(DEVICE)
                                    for _ in range(2))
        num_slots = sum(seq_lens) + 3
        perm = torch.randperm(num_slots, generator=gen)[:sum(seq_lens)]  # slots out of order, some unused
        self.kv_indptr = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], device=DEVICE)
        self.kv_indices = perm.to(DEVICE)
        self.loc = self.kv_indices[self.kv_indptr[1:] - 1].clone()
        self.positions = torch.tensor(seq_lens, device=DEVICE) - 1
        past = torch.randn(2, num_slots, kv_heads, head_dim, generator=gen)
        self.k_buf, self.v_buf = (past[i].to(pool_dtype).to(DEVICE) for i in range(2))
        rotary = RotaryEmbedding(head_dim, MAX_POSITIONS, 1000000.0, None)
        self.cos, self.sin = rotary.cos_cache.to(DEVICE), rotary.sin_cache.to(DEVICE)

    def views(self, qkv: torch.Tensor) -> list[torch.Tensor]:
        """q, k, v: strided `[batch, heads, head_dim]` views of `qkv`."""
        return [t.view(qkv.shape[0], -1, self.head_dim) for t in qkv.split(self.sizes, -1)]

    def rope(self, qkv: torch.Tensor, eps: float = 1e-6) -> DecodeRope:
        _, k, v = self.views(qkv)
        return DecodeRope(k, v, self.q_norm, self.k_norm, eps, self.cos, self.sin, self.positions, self.loc)


def run_both(step: Step, num_kv_splits: int, k_scale: float = 1.0,
             v_scale: float = 1.0) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]:
    """(output, k pool, v pool) of the unfused launches, then of the fused one, from the same inputs."""
    results = []
    for fused in (False, True):
        qkv, k_buf, v_buf = step.qkv.clone(), step.k_buf.clone(), step.v_buf.clone()
        q, k, v = step.views(qkv)
        out = torch.empty(q.shape, dtype=q.dtype, device=DEVICE)
        scratch = DecodeScratch.allocate(q.shape[0], step.heads, step.head_dim, num_kv_splits, DEVICE)
        if not fused:
            apply_rotary_(q, k, step.positions, step.cos, step.sin,
                          KVStoreTarget(v, k_buf, v_buf, step.loc, k_scale, v_scale),
                          QKNorm(step.q_norm, step.k_norm, 1e-6))
        decode_attention_fwd(q, k_buf, v_buf, out, step.kv_indptr, step.kv_indices, step.head_dim ** -0.5,
                             num_kv_splits, scratch, k_scale, v_scale, rope=step.rope(qkv) if fused else None)
        results.append((out, k_buf, v_buf))
    return results[0], results[1]


def assert_same_bits(want: tuple[torch.Tensor, ...], got: tuple[torch.Tensor, ...]) -> None:
    for name, a, b in zip(("output", "k pool", "v pool"), want, got):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name} differs"


@pytest.mark.parametrize("case", list(LENGTH_CASES))
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
def test_fused_rope_equals_rotary_then_decode_float32(case: str, heads: int, kv_heads: int) -> None:
    seq_lens, splits = LENGTH_CASES[case]
    want, got = run_both(Step(seq_lens, heads, kv_heads, 64, torch.float32, torch.float32), splits)
    assert_same_bits(want, got)


@pytest.mark.parametrize("case", ["one-token", "last-split", "batch-3"])
def test_fused_rope_equals_rotary_then_decode_bfloat16(case: str) -> None:
    seq_lens, splits = LENGTH_CASES[case]
    want, got = run_both(Step(seq_lens, 8, 2, 128, torch.bfloat16, torch.bfloat16, seed=1), splits)
    assert_same_bits(want, got)


def test_fused_rope_stores_into_an_fp8_pool_as_the_rotary_kernel_does() -> None:
    step = Step([3, 140], 4, 2, 64, torch.bfloat16, E4M3, seed=2)
    want, got = run_both(step, 2, k_scale=0.25, v_scale=0.5)
    assert_same_bits(want, got)


def test_fused_rope_leaves_other_slots_and_q_alone() -> None:
    step = Step([70, 3], 8, 2, 64, torch.float32, torch.float32, seed=3)
    qkv, k_buf = step.qkv.clone(), step.k_buf.clone()
    q = step.views(qkv)[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=DEVICE)
    decode_attention_fwd(q, k_buf, step.v_buf.clone(), out, step.kv_indptr, step.kv_indices, 0.125, 3,
                         rope=step.rope(qkv))
    assert torch.equal(qkv, step.qkv), "the raw q/k/v projection is only read"
    others = torch.ones(k_buf.shape[0], dtype=torch.bool, device=DEVICE)
    others[step.loc] = False
    assert torch.equal(k_buf[others], step.k_buf[others])


def test_fused_rope_launcher_checks_its_inputs() -> None:
    step = Step([4, 6], 8, 2, 64, torch.float32, torch.float32)
    q, _, _ = step.views(step.qkv)
    out = torch.empty(q.shape, dtype=q.dtype, device=DEVICE)
    rope = step.rope(step.qkv)

    def launch(bad: DecodeRope, **kwargs: object) -> None:
        decode_attention_fwd(q, step.k_buf, step.v_buf, out, step.kv_indptr, step.kv_indices, 0.125, 2,
                             rope=bad, **kwargs)  # type: ignore[arg-type]

    with pytest.raises(AssertionError, match="not with kv_lens"):
        launch(rope, kv_lens=torch.tensor([4, 6], device=DEVICE))
    with pytest.raises(AssertionError, match="k has shape"):
        launch(rope._replace(k=rope.k[:1]))
    with pytest.raises(AssertionError, match="q_norm has shape"):
        launch(rope._replace(q_norm=rope.q_norm[:32]))
    with pytest.raises(AssertionError, match="cos_cache must be float32"):
        launch(rope._replace(cos_cache=rope.cos_cache.double()))
    with pytest.raises(AssertionError, match="loc has dtype"):
        launch(rope._replace(loc=rope.loc.float()))
    with pytest.raises(AssertionError, match="positions has shape"):
        launch(rope._replace(positions=rope.positions[:1]))
    with pytest.raises(AssertionError, match="v must have a contiguous last dim"):
        launch(rope._replace(v=torch.empty(2, 2, 128, device=DEVICE)[..., ::2]))
    odd = Step([4], 2, 1, 48, torch.float32, torch.float32)
    q48 = odd.views(odd.qkv)[0]
    with pytest.raises(AssertionError, match="power-of-2 head_dim"):
        decode_attention_fwd(q48, odd.k_buf, odd.v_buf, torch.empty_like(q48), odd.kv_indptr, odd.kv_indices,
                             0.125, 1, rope=odd.rope(odd.qkv))
