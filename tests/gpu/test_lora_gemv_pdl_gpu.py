"""The batch-1 LoRA GEMVs under programmatic dependent launch (Hopper; skipped elsewhere): a shrink lets its GEMV
start at once, and the GEMV reads its input before waiting (radixmesh.kernels.lora_gemv). A chain of projections,
each one's input the output of the one before, replayed in a CUDA graph and run eagerly with PDL, must give the
bits the same launches give without PDL: a GEMV that read its input before the kernel writing it had ended, or an
epilogue that read the shrink's sums early, would differ."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels._pdl import pdl_enabled, set_pdl
from radixmesh.kernels.gemv import gemv
from radixmesh.kernels.gemv_fused import gemv_add_rmsnorm
from radixmesh.kernels.lora_gemv import lora_gemv_shrink

pytestmark = pytest.mark.gpu
K, RANK, DEPTH = 4096, 16, 12


def _operands(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

    return {"w": rand(DEPTH, K, K, scale=K ** -0.5), "a": rand(DEPTH, 1, RANK, K, scale=K ** -0.5),
            "b": rand(DEPTH, 1, K, RANK, scale=0.05), "nw": 1 + rand(K, scale=0.1)}


SLOW_SHRINK = (1, 16, 1)
"""Shrink tiles that take far longer than the GEMV (one program, one warp, 16 features a step): a GEMV epilogue that
did not wait for its shrink would read unfinished sums, and a GEMV started before the kernel ahead of its shrink
ended (that GEMV waits for its own slow shrink before storing) would read an old input."""


def _chain(ops: dict[str, torch.Tensor], x: torch.Tensor, residual: torch.Tensor, norm: bool,
           tiles: tuple[int, int, int] | None) -> torch.Tensor:
    """DEPTH projections with the adapter in the GEMV's epilogue: plain (x -> W x + adapter) or with the fused
    norm (the next x is the output, the next residual the sum the kernel writes); `tiles`: the shrinks'."""
    slots = torch.zeros(1, dtype=torch.int32, device="cuda")
    ranks = torch.full((1,), RANK, dtype=torch.int32, device="cuda")
    scalings = torch.full((1,), 2.0, dtype=torch.float32, device="cuda")
    for i in range(DEPTH):
        a, b = ops["a"][i], ops["b"][i]
        if norm:
            lora = lora_gemv_shrink(x, a, b, slots, ranks, scalings, (K,), residual, ops["nw"], tiles=tiles)
            x, residual = gemv_add_rmsnorm(x, residual, ops["nw"], 1e-5, ops["w"][i], lora=lora)
        else:
            x = gemv(x, ops["w"][i], lora=lora_gemv_shrink(x, a, b, slots, ranks, scalings, (K,), tiles=tiles))
    return torch.cat([x, residual])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a GPU with PDL (compute capability 9.0+)")
@pytest.mark.parametrize("tiles", [None, SLOW_SHRINK], ids=["default", "slow"])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
def test_chained_epilogue_gemvs_under_pdl_equal_them_without(norm: bool, tiles: tuple[int, int, int] | None) -> None:
    """Each run starts from another input, so a read of a buffer before its writer ended sees another run's values
    (the graph's buffers hold the last replay's). gpu_suite's lora-pdl-mutants stage checks that the slow case
    fails on kernels broken either way."""
    ops = _operands(seed=3)
    inputs = [(torch.randn(1, K, device="cuda").to(torch.bfloat16), torch.randn(1, K, device="cuda").to(torch.bfloat16))
              for _ in range(8)]
    try:
        set_pdl(False)
        wants = [_chain(ops, x, r, norm, tiles) for x, r in inputs]
        set_pdl(True)
        assert pdl_enabled(inputs[0][0].device)
        for (x, r), want in zip(inputs, wants):
            assert torch.equal(_chain(ops, x, r, norm, tiles), want), "eager launches under PDL"
        x_in, r_in = inputs[0][0].clone(), inputs[0][1].clone()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out = _chain(ops, x_in, r_in, norm, tiles)
        torch.cuda.synchronize()
        for turn in range(3 * len(inputs)):
            j = turn % len(inputs)
            x_in.copy_(inputs[j][0])
            r_in.copy_(inputs[j][1])
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, wants[j]), f"replay {turn}: max diff {(out.float() - wants[j].float()).abs().max()}"
    finally:
        set_pdl(True)
    for want in wants:
        assert torch.isfinite(want.float()).all() and want.float().abs().max() > 0
    assert not torch.equal(wants[0], wants[1])
