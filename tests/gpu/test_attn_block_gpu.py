"""The one-launch attention half compiled on a GPU at the Qwen3-30B-A3B shape, against the launches it replaces
(`gemv_add_rmsnorm`, the decode split kernel with the rotary and its merge, `gemv`): 1, 2 and 4 programs per SM,
PDL on and off, split counts, the o weight's L2 prefetch, request lengths from 1 slot up, and a CUDA graph of
chained layers replayed 50 times (skipped without CUDA). Every check also asserts that no grid barrier timed out
and that the counters are back at 0."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # skipped then; keep the CPU tests' interpreter mode

from dataclasses import replace

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


PRELOADED = AttnBlockConfig(num_splits=64, kv_preload=32, o_preload=True)


@pytest.mark.parametrize("ctas", [1, 2, 4])
@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("preload", [False, True])
def test_block_matches_the_chain(ctas: int, pdl: bool, preload: bool) -> None:
    lay = _layers(1024)
    set_pdl(pdl)
    try:
        _compare(lay, replace(PRELOADED if preload else AttnBlockConfig(), ctas_per_sm=ctas))
    finally:
        set_pdl(True)


@pytest.mark.parametrize("context", [1, 15, 16, 17, 300, 4099])
@pytest.mark.parametrize("cfg", [AttnBlockConfig(), AttnBlockConfig(num_splits=64, o_prefetch=True),
                                 AttnBlockConfig(num_splits=8, qkv_block_r=8, qkv_block_k=256), PRELOADED,
                                 AttnBlockConfig(kv_preload=16, o_preload=True, ctas_per_sm=2),
                                 AttnBlockConfig(qkv_prefetch=True, o_prefetch=True)],
                         ids=["default", "splits64-prefetch", "splits8-tiles", "preloaded", "preload16-ctas2",
                              "prefetched"])
def test_request_lengths_and_configs(context: int, cfg: AttnBlockConfig) -> None:
    _compare(_layers(context), cfg)


def test_a_graph_of_chained_layers_replays() -> None:
    lay = _layers(777, num=4)
    cfg = PRELOADED
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
