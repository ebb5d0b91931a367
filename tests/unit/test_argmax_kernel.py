"""The chunked argmax kernel vs `torch.argmax` (under the Triton interpreter without CUDA)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.kernels.argmax import argmax_rows

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("batch,vocab", [(1, 5), (1, 49152), (3, 4099), (9, 2048), (2, 128256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_matches_torch(batch, vocab, dtype):
    gen = torch.Generator().manual_seed(batch * vocab)
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    want = torch.argmax(logits.float(), dim=-1)
    assert argmax_rows(logits.to(DEVICE)).cpu().tolist() == want.tolist()


def test_argmax_ties_pick_the_first_index_across_chunks():
    logits = torch.full((4, 10000), -5.0)
    logits[0, [7000, 300, 9999]] = 2.0  # equal maxima in different chunks
    logits[1, [4096, 4097]] = 1.0  # equal maxima side by side at a block edge
    logits[2] = float("-inf")  # nothing allowed: index 0, like torch
    logits[3, 9999] = float("inf")
    got = argmax_rows(logits.to(DEVICE)).cpu().tolist()
    assert got == torch.argmax(logits, dim=-1).tolist() == [300, 4096, 0, 9999]


def test_argmax_strided_rows_and_bad_input():
    base = torch.randn(3, 6000)
    view = base[:, :5000]  # row stride 6000
    assert argmax_rows(view.to(DEVICE)).cpu().tolist() == torch.argmax(view, dim=-1).tolist()
    with pytest.raises(AssertionError, match="must be \\[batch, vocab\\]"):
        argmax_rows(torch.randn(5, device=DEVICE))
    with pytest.raises(AssertionError, match="dtype"):
        argmax_rows(torch.zeros(2, 3, dtype=torch.int64, device=DEVICE))
