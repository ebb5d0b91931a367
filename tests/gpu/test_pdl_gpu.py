"""Programmatic dependent launch (`radixmesh.kernels._pdl`) on a Hopper GPU: chains of the batch-1 decode kernels,
each reading what the one before wrote, captured in a CUDA graph, give bitwise the outputs of the same chain
launched without PDL. A kernel that read its input (or wrote) before its `gdc_wait` would race and differ."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # skipped then; keep the CPU tests' interpreter mode

import pytest

from radixmesh.kernels._pdl import pdl_enabled, set_pdl

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, CONTEXT = 1024, 2816, 16, 4, 64, 12, 700


def _needs_hopper() -> None:
    if torch.cuda.get_device_capability(DEVICE)[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")


def _layer_chain(fp8: bool) -> tuple[object, list[torch.Tensor]]:
    """One decode step's kernel sequence over LAYERS layers at batch 1: norm+qkv GEMV, rotary with the KV store,
    split-KV attention and merge, o GEMV, norm+gate/up GEMV (gated), down GEMV. Returns (run, outputs)."""
    from radixmesh.kernels.decode_attention import DecodeScratch, decode_attention_fwd
    from radixmesh.kernels.fp8_quant import quantize_rows
    from radixmesh.kernels.fused import KVStoreTarget, apply_rotary_
    from radixmesh.kernels.gemv import gemv, gemv_fp8
    from radixmesh.kernels.gemv_fused import gemv_add_rmsnorm

    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(torch.bfloat16)

    def weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = rand(n, k)
        return quantize_rows(w) if fp8 else (w, None)

    qkv_n = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    layers = [dict(qkv=weight(qkv_n, HIDDEN), o=weight(HIDDEN, HEADS * HEAD_DIM), gate_up=weight(2 * INTER, HIDDEN),
                   down=weight(HIDDEN, INTER), n1=rand(HIDDEN, scale=1.0), n2=rand(HIDDEN, scale=1.0),
                   k=rand(CONTEXT + 1, KV_HEADS, HEAD_DIM, scale=1.0),
                   v=rand(CONTEXT + 1, KV_HEADS, HEAD_DIM, scale=1.0))
              for _ in range(LAYERS)]
    x0, r0 = rand(1, HIDDEN, scale=1.0), rand(1, HIDDEN, scale=1.0)
    positions = torch.tensor([CONTEXT], device=DEVICE)
    loc = torch.tensor([CONTEXT], device=DEVICE)
    kv_indptr = torch.tensor([0, CONTEXT + 1], dtype=torch.int32, device=DEVICE)
    kv_indices = torch.arange(CONTEXT + 1, dtype=torch.int32, device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, device=DEVICE, dtype=torch.float32) / HEAD_DIM))
    freqs = torch.outer(torch.arange(CONTEXT + 8, device=DEVICE, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    scratch = DecodeScratch.allocate(1, HEADS, HEAD_DIM, 8, DEVICE)
    attn_out = torch.empty(1, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    outputs: list[torch.Tensor] = []

    def lin(x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        return gemv_fp8(x, w[0], w[1]) if w[1] is not None else gemv(x, w[0])

    def run() -> None:
        outputs.clear()
        x, r = x0, r0
        for layer in layers:
            qkv, r = gemv_add_rmsnorm(x, r, layer["n1"], 1e-5, *layer["qkv"])
            q, k, v = qkv.view(1, -1, HEAD_DIM).split([HEADS, KV_HEADS, KV_HEADS], dim=1)
            apply_rotary_(q, k, positions, cos, sin, KVStoreTarget(v, layer["k"], layer["v"], loc, 1.0, 1.0))
            decode_attention_fwd(q, layer["k"], layer["v"], attn_out, kv_indptr, kv_indices, HEAD_DIM ** -0.5, 8,
                                 scratch)
            x = lin(attn_out.view(1, -1), layer["o"])
            act, r = gemv_add_rmsnorm(x, r, layer["n2"], 1e-5, *layer["gate_up"], gated=True)
            x = lin(act, layer["down"])
            outputs.extend([qkv, attn_out.clone(), x, r])

    return run, outputs


def _graph_outputs(fp8: bool, pdl: bool) -> list[torch.Tensor]:
    set_pdl(pdl)
    try:
        run, outputs = _layer_chain(fp8)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # compile and warm outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        return [t.clone() for t in outputs]
    finally:
        set_pdl(True)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_pdl_chain_in_a_graph_equals_the_chain_without_pdl(fp8: bool) -> None:
    _needs_hopper()
    assert pdl_enabled(DEVICE)
    with_pdl = _graph_outputs(fp8, pdl=True)
    without = _graph_outputs(fp8, pdl=False)
    assert len(with_pdl) == len(without) == 4 * LAYERS
    for i, (a, b) in enumerate(zip(with_pdl, without)):
        assert not torch.isnan(a).any(), f"output {i}: NaN"
        diff = float((a.float() - b.float()).abs().max())
        assert torch.equal(a, b), f"output {i} (layer {i // 4}) differs with PDL: max difference {diff}"


def test_pdl_off_below_hopper_and_when_disabled() -> None:
    set_pdl(False)
    try:
        assert not pdl_enabled(DEVICE)
    finally:
        set_pdl(True)
    assert pdl_enabled(DEVICE) == (torch.cuda.get_device_capability(DEVICE)[0] >= 9)
