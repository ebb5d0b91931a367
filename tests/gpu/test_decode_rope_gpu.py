"""The decode attention kernel with the rotary work inside (`decode_attention_fwd(..., rope=...)`) against
`apply_rotary_` (KV store, q/k norms) then `decode_attention_fwd`, compiled at the Qwen3-8B shape (32 q heads,
4 KV heads, head_dim 128, bf16) with the engine's split count and PDL as the engine launches it: pool rows the same
bits, outputs within a bf16 rounding; and the fused launch replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels.decode_attention import choose_num_kv_splits, get_num_sms

from ..unit.test_decode_rope import Step, run_both

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128
E4M3 = torch.float8_e4m3fn


def engine_splits(seq_lens: list[int]) -> int:
    return choose_num_kv_splits(len(seq_lens), KV_HEADS, max(seq_lens), get_num_sms(torch.device("cuda")))


def assert_matches(want: tuple[torch.Tensor, ...], got: tuple[torch.Tensor, ...], step: Step) -> None:
    """Pool rows of the new tokens the same bits; outputs within bf16 rounding (the q norm's sum may be reduced in
    another order than the rotary kernel's)."""
    for name, a, b in (("k pool", want[1], got[1]), ("v pool", want[2], got[2])):
        diff = (a[step.loc].view(torch.uint8) != b[step.loc].view(torch.uint8)).sum().item()
        assert diff == 0, f"{name}: {diff} bytes of the new tokens' rows differ"
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name}: other rows changed"
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-3, rtol=1.6e-2)
    print(f"output max abs diff {(got[0].float() - want[0].float()).abs().max().item():.3e}, "
          f"bit-equal: {torch.equal(got[0], want[0])}")


@pytest.mark.parametrize("seq_lens", [[1], [300], [4096], [1, 300, 4096]], ids=str)
def test_fused_rope_matches_rotary_then_decode_at_the_qwen3_8b_shape(seq_lens: list[int]) -> None:
    step = Step(seq_lens, HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.bfloat16)
    want, got = run_both(step, engine_splits(seq_lens))
    assert_matches(want, got, step)


def test_fused_rope_into_an_fp8_pool() -> None:
    seq_lens = [300, 4096]
    step = Step(seq_lens, HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, E4M3, seed=2)
    want, got = run_both(step, engine_splits(seq_lens), k_scale=0.25, v_scale=0.5)
    assert_matches(want, got, step)


def test_fused_rope_replays_from_a_cuda_graph() -> None:
    from radixmesh.kernels.decode_attention import DecodeScratch, decode_attention_fwd

    seq_lens = [300, 4096]
    step = Step(seq_lens, HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.bfloat16, seed=4)
    splits = engine_splits(seq_lens)
    _, eager = run_both(step, splits)  # the fused launch, uncaptured
    q = step.views(step.qkv)[0]
    out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
    k_buf, v_buf = step.k_buf.clone(), step.v_buf.clone()
    scratch = DecodeScratch.allocate(len(seq_lens), HEADS, HEAD_DIM, splits, "cuda")

    def launch() -> None:
        decode_attention_fwd(q, k_buf, v_buf, out, step.kv_indptr, step.kv_indices, HEAD_DIM ** -0.5, splits,
                             scratch, rope=step.rope(step.qkv))

    launch()  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    out.zero_()
    k_buf.copy_(step.k_buf)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager[0])
    assert torch.equal(k_buf, eager[1]) and torch.equal(v_buf, eager[2])
