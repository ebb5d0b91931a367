"""The one-launch attention half compiled on a GPU at the Qwen3-30B-A3B shape, against the launches it replaces
(`gemv_add_rmsnorm`, the decode split kernel with the rotary and its merge, `gemv`): 1, 2 and 4 programs per SM,
PDL on and off, split counts and tiles, request lengths from 1 slot up, and a CUDA graph of
chained layers replayed 50 times (skipped without CUDA). Every check also asserts that no grid barrier timed out
and that the counters are back at 0."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # skipped then; keep the CPU tests' interpreter mode


import pytest

from radixmesh.kernels._pdl import set_pdl
from radixmesh.kernels.attn_block import AttnBlockConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _layers(context: int, num: int = 2):  # type: ignore[no-untyped-def]
    from radixmesh.kernels.bench_attn_block import MAX_SPLITS, SHAPES, make_layers

    return make_layers(SHAPES["qwen3-30b-a3b"], num, context, MAX_SPLITS)


def _compare(lay, cfg: AttnBlockConfig) -> None:  # type: ignore[no-untyped-def]
    want, want_summed = (t.clone() for t in lay.chain(0))
    new_k = lay.k_bufs[0][lay.loc].clone()
    out, summed = (t.clone() for t in lay.block(0, cfg))
    assert not lay.ws.timed_out()
    assert lay.ws.sync[:2].tolist() == [0, 0]
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(lay.k_bufs[0][lay.loc], new_k, atol=2e-2, rtol=2e-2)
    rel = float((out.float() - want.float()).norm() / want.float().norm())
    assert rel < 1e-2, rel


@pytest.mark.parametrize("ctas", [1, 2, 4])
@pytest.mark.parametrize("pdl", [True, False])
def test_block_matches_the_chain(ctas: int, pdl: bool) -> None:
    lay = _layers(1024)
    set_pdl(pdl)
    try:
        _compare(lay, AttnBlockConfig(ctas_per_sm=ctas))
    finally:
        set_pdl(True)


@pytest.mark.parametrize("context", [1, 15, 16, 17, 300, 4099])
@pytest.mark.parametrize("cfg", [AttnBlockConfig(), AttnBlockConfig(num_splits=64),
                                 AttnBlockConfig(num_splits=8, qkv_block_r=8, qkv_block_k=256, ctas_per_sm=2)],
                         ids=["default", "splits64", "splits8-tiles-ctas2"])
def test_request_lengths_and_configs(context: int, cfg: AttnBlockConfig) -> None:
    _compare(_layers(context), cfg)


def test_a_graph_of_chained_layers_replays() -> None:
    lay = _layers(777, num=4)
    cfg = AttnBlockConfig()
    want = [lay.block(i, cfg)[0].clone() for i in range(4)]  # eager (the layers share `lay.out`)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(4):
            lay.block(i, cfg)
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    assert not lay.ws.timed_out()
    assert lay.ws.sync[:2].tolist() == [0, 0]
    assert torch.equal(lay.out, want[-1])
