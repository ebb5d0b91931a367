"""KV gather/scatter kernels vs plain PyTorch indexing, at small shapes.

Without CUDA the Triton kernels run on CPU under the Triton interpreter (slow: shapes stay tiny).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # must precede the first import of triton (radixmesh.kernels): @triton.jit reads it then
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from radixmesh.kernels.kv_transfer import gather_kv, scatter_kv
from radixmesh.kernels.kv_transfer_ref import gather_kv_torch, scatter_kv_torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_pool(num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)

    def rand() -> torch.Tensor:
        return torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)

    return [rand() for _ in range(num_layers)], [rand() for _ in range(num_layers)]


def expected_gather(k_bufs: list[torch.Tensor], v_bufs: list[torch.Tensor], slots: list[int]) -> torch.Tensor:
    """[num_layers, 2, num_tokens, kv_heads, head_dim] by slicing one token at a time."""
    layers = []
    for k, v in zip(k_bufs, v_bufs):
        layers.append(torch.stack([torch.stack([k[s] for s in slots]), torch.stack([v[s] for s in slots])]))
    return torch.stack(layers)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize(("kv_heads", "head_dim", "dtype"), [(2, 8, torch.float32), (3, 12, torch.bfloat16),
                                                             (1, 16, torch.float16)])
def test_gather_matches_slicing(impl: str, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    k_bufs, v_bufs = make_pool(3, 40, kv_heads, head_dim, dtype)
    slots = [7, 3, 39, 12, 1, 20]
    out = torch.empty(3, 2, len(slots), kv_heads, head_dim, dtype=dtype, device=DEVICE)
    fn = gather_kv if impl == "triton" else gather_kv_torch
    fn(k_bufs, v_bufs, torch.tensor(slots, device=DEVICE), out)
    assert torch.equal(out, expected_gather(k_bufs, v_bufs, slots))


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_scatter_inverts_gather_on_a_layer_range(impl: str) -> None:
    src_k, src_v = make_pool(4, 30, 2, 8, torch.float32, seed=1)
    dst_k, dst_v = make_pool(4, 50, 2, 8, torch.float32, seed=2)
    before_k = [b.clone() for b in dst_k]
    src_slots = torch.tensor([5, 6, 7, 29], device=DEVICE)
    dst_slots = torch.tensor([40, 2, 17, 33], dtype=torch.int32, device=DEVICE)
    packed = torch.empty(2, 2, 4, 2, 8, device=DEVICE)
    gather, scatter = (gather_kv, scatter_kv) if impl == "triton" else (gather_kv_torch, scatter_kv_torch)
    gather(src_k, src_v, src_slots, packed, layer_begin=1)  # layers 1 and 2
    scatter(dst_k, dst_v, dst_slots, packed, layer_begin=1)
    for layer in (1, 2):
        assert torch.equal(dst_k[layer][dst_slots.long()], src_k[layer][src_slots])
        assert torch.equal(dst_v[layer][dst_slots.long()], src_v[layer][src_slots])
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[dst_slots.long().cpu()] = False
    for layer in (0, 3):  # outside the range: nothing written
        assert torch.equal(dst_k[layer], before_k[layer])
    assert torch.equal(dst_k[1][untouched.to(DEVICE)], before_k[1][untouched.to(DEVICE)])


def test_empty_slot_list_is_a_no_op() -> None:
    k_bufs, v_bufs = make_pool(2, 10, 2, 8, torch.float32)
    before = [b.clone() for b in k_bufs]
    empty = torch.empty(2, 2, 0, 2, 8, device=DEVICE)
    scatter_kv(k_bufs, v_bufs, torch.empty(0, dtype=torch.int64, device=DEVICE), empty)
    assert all(torch.equal(a, b) for a, b in zip(k_bufs, before))


def test_launchers_reject_bad_arguments() -> None:
    k_bufs, v_bufs = make_pool(2, 10, 2, 8, torch.float32)
    slots = torch.tensor([1, 2, 3], device=DEVICE)
    with pytest.raises(AssertionError, match="out has shape"):
        gather_kv(k_bufs, v_bufs, slots, torch.empty(2, 2, 4, 2, 8, device=DEVICE))
    with pytest.raises(AssertionError, match="bit for bit"):
        gather_kv(k_bufs, v_bufs, slots, torch.empty(2, 2, 3, 2, 8, dtype=torch.float16, device=DEVICE))
    with pytest.raises(AssertionError, match="outside the pool"):
        scatter_kv(k_bufs, v_bufs, slots, torch.empty(2, 2, 3, 2, 8, device=DEVICE), layer_begin=1)
    with pytest.raises(AssertionError, match="slots has dtype"):
        scatter_kv(k_bufs, v_bufs, slots.float(), torch.empty(2, 2, 3, 2, 8, device=DEVICE))
    with pytest.raises(AssertionError, match="must be contiguous"):
        gather_kv(k_bufs, v_bufs, slots, torch.empty(2, 2, 3, 8, 2, device=DEVICE).transpose(3, 4))
    with pytest.raises(AssertionError, match="as many K as V"):
        gather_kv(k_bufs, v_bufs[:1], slots, torch.empty(2, 2, 3, 2, 8, device=DEVICE))
