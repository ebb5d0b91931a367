"""Token-major KV gather/scatter (the host tier's layout) vs per-token slicing, at small shapes.

Without CUDA the Triton kernels run on CPU under the Triton interpreter (slow: shapes stay tiny).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # must precede the first import of triton (radixmesh.kernels): @triton.jit reads it then
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from radixmesh.kernels.kv_host import gather_kv_tokens, scatter_kv_tokens
from radixmesh.kernels.kv_host_ref import gather_kv_tokens_torch, scatter_kv_tokens_torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GATHER = {"triton": gather_kv_tokens, "torch": gather_kv_tokens_torch}
SCATTER = {"triton": scatter_kv_tokens, "torch": scatter_kv_tokens_torch}


def make_pool(num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)

    def rand() -> torch.Tensor:
        return torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)

    return [rand() for _ in range(num_layers)], [rand() for _ in range(num_layers)]


def expected_tokens(k_bufs: list[torch.Tensor], v_bufs: list[torch.Tensor], slots: list[int]) -> torch.Tensor:
    """[num_tokens, num_layers, 2, kv_heads, head_dim], one token at a time."""
    return torch.stack([torch.stack([torch.stack([k[s], v[s]]) for k, v in zip(k_bufs, v_bufs)]) for s in slots])


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize(("kv_heads", "head_dim", "dtype"), [(2, 8, torch.float32), (3, 12, torch.bfloat16),
                                                             (1, 16, torch.float16)])
def test_gather_tokens_matches_slicing(impl: str, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    k_bufs, v_bufs = make_pool(3, 40, kv_heads, head_dim, dtype)
    slots = [7, 3, 39, 12, 1, 20]
    out = torch.full((len(slots), 3, 2, kv_heads, head_dim), -7.0, dtype=dtype, device=DEVICE)
    GATHER[impl](k_bufs, v_bufs, torch.tensor(slots, device=DEVICE), out)
    assert torch.equal(out, expected_tokens(k_bufs, v_bufs, slots))


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_scatter_tokens_inverts_gather_and_touches_nothing_else(impl: str) -> None:
    src_k, src_v = make_pool(4, 30, 2, 8, torch.float32, seed=1)
    dst_k, dst_v = make_pool(4, 50, 2, 8, torch.float32, seed=2)
    before_k, before_v = [b.clone() for b in dst_k], [b.clone() for b in dst_v]
    src_slots = torch.tensor([5, 6, 7, 29], device=DEVICE)
    dst_slots = torch.tensor([40, 2, 17, 33], dtype=torch.int32, device=DEVICE)
    packed = torch.empty(4, 4, 2, 2, 8, device=DEVICE)
    GATHER[impl](src_k, src_v, src_slots, packed)
    SCATTER[impl](dst_k, dst_v, dst_slots, packed)
    others = torch.ones(50, dtype=torch.bool)
    others[dst_slots.long().cpu()] = False
    for layer in range(4):
        assert torch.equal(dst_k[layer][dst_slots.long()], src_k[layer][src_slots])
        assert torch.equal(dst_v[layer][dst_slots.long()], src_v[layer][src_slots])
        assert torch.equal(dst_k[layer][others.to(DEVICE)], before_k[layer][others.to(DEVICE)])
        assert torch.equal(dst_v[layer][others.to(DEVICE)], before_v[layer][others.to(DEVICE)])


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_empty_slots_is_a_no_op(impl: str) -> None:
    k_bufs, v_bufs = make_pool(2, 8, 2, 8, torch.float32)
    GATHER[impl](k_bufs, v_bufs, torch.empty(0, dtype=torch.int64, device=DEVICE),
                 torch.empty(0, 2, 2, 2, 8, device=DEVICE))


def test_launcher_names_a_layout_mismatch() -> None:
    k_bufs, v_bufs = make_pool(2, 8, 2, 8, torch.float32)
    wrong = torch.empty(2, 2, 3, 2, 8, device=DEVICE)  # layer-major, not token-major
    with pytest.raises(AssertionError, match=r"out has shape \(2, 2, 3, 2, 8\), expected \(3, 2, 2, 2, 8\)"):
        gather_kv_tokens(k_bufs, v_bufs, torch.tensor([1, 2, 3], device=DEVICE), wrong)
    with pytest.raises(AssertionError, match="dtype"):
        gather_kv_tokens(k_bufs, v_bufs, torch.tensor([1], device=DEVICE),
                         torch.empty(1, 2, 2, 2, 8, dtype=torch.float16, device=DEVICE))
