"""KV gather/scatter kernels and the pool-to-pool pull (through an address table) vs plain PyTorch indexing,
at small shapes.

Without CUDA the Triton kernels run on CPU under the Triton interpreter (slow: shapes stay tiny).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # must precede the first import of triton (radixmesh.kernels): @triton.jit reads it then
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from radixmesh.kernels import kv_transfer
from radixmesh.kernels.kv_transfer import gather_kv, make_kv_row_table, pull_kv_rows, scatter_kv
from radixmesh.kernels.kv_transfer_ref import gather_kv_torch, pull_kv_rows_torch, scatter_kv_torch

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


Pool = tuple[list[torch.Tensor], list[torch.Tensor]]


def pull(impl: str, src: Pool, dst: Pool, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    if impl == "triton":
        pull_kv_rows(make_kv_row_table(*src, *dst), src_slots, dst_slots)
    else:
        pull_kv_rows_torch(*src, *dst, src_slots, dst_slots)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize(("kv_heads", "head_dim", "dtype", "word_bytes"),
                         [(2, 8, torch.float32, 8), (3, 5, torch.float16, 2), (1, 16, torch.bfloat16, 8),
                          (2, 6, torch.float8_e4m3fn, 4), (1, 3, torch.float8_e4m3fn, 1)])
def test_pull_copies_every_layer_between_pools(impl: str, kv_heads: int, head_dim: int, dtype: torch.dtype,
                                               word_bytes: int) -> None:
    src = make_pool(3, 30, kv_heads, head_dim, dtype, seed=1)
    dst = make_pool(3, 45, kv_heads, head_dim, dtype, seed=2)
    before = [b.clone() for b in (*dst[0], *dst[1])]
    src_slots = torch.tensor([5, 29, 1, 17, 6], device=DEVICE)
    dst_slots = torch.tensor([44, 3, 20, 2, 31], dtype=torch.int32, device=DEVICE)
    if impl == "triton":
        assert make_kv_row_table(*src, *dst).word_bytes == word_bytes
    pull(impl, src, dst, src_slots, dst_slots)
    untouched = torch.ones(45, dtype=torch.bool, device=DEVICE)
    untouched[dst_slots.long()] = False
    for src_buf, dst_buf, old in zip((*src[0], *src[1]), (*dst[0], *dst[1]), before):
        assert torch.equal(dst_buf.view(torch.uint8)[dst_slots.long()], src_buf.view(torch.uint8)[src_slots])
        assert torch.equal(dst_buf[untouched].view(torch.uint8), old[untouched].view(torch.uint8))


def test_pull_loops_over_token_blocks_and_row_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_transfer, "_PULL_MAX_ROW_BLOCK", 4)  # rows of 6 words: two chunks, the second masked
    monkeypatch.setattr(kv_transfer, "_PULL_TILE_WORDS", 8)  # two tokens per program: the last block masked
    src, dst = make_pool(2, 20, 3, 4, torch.float32, seed=3), make_pool(2, 20, 3, 4, torch.float32, seed=4)
    expected = ([b.clone() for b in dst[0]], [b.clone() for b in dst[1]])
    src_slots = torch.tensor([3, 4, 19, 0, 8], device=DEVICE)
    dst_slots = torch.tensor([1, 2, 3, 4, 5], device=DEVICE)
    pull_kv_rows_torch(*src, *expected, src_slots, dst_slots)
    pull_kv_rows(make_kv_row_table(*src, *dst), src_slots, dst_slots)
    assert all(torch.equal(a, b) for a, b in zip((*dst[0], *dst[1]), (*expected[0], *expected[1])))


def test_pull_from_unaligned_buffers_moves_narrower_words() -> None:
    def unaligned(num_slots: int, seed: int) -> list[torch.Tensor]:  # starts 2 bytes into an allocation
        gen = torch.Generator().manual_seed(seed)
        return [torch.randn(num_slots * 16 + 1, generator=gen).half().to(DEVICE)[1:].view(num_slots, 2, 8)
                for _ in range(2)]

    src, dst = (unaligned(12, 5), unaligned(12, 6)), (unaligned(10, 7), unaligned(10, 8))
    table = make_kv_row_table(*src, *dst)
    assert table.word_bytes == 2 and not table.aligned
    src_slots, dst_slots = torch.tensor([11, 0, 4], device=DEVICE), torch.tensor([9, 1, 0], device=DEVICE)
    pull_kv_rows(table, src_slots, dst_slots)
    for src_buf, dst_buf in zip((*src[0], *src[1]), (*dst[0], *dst[1])):
        assert torch.equal(dst_buf[dst_slots], src_buf[src_slots])


def test_pull_of_no_tokens_is_a_no_op() -> None:
    src, dst = make_pool(1, 4, 1, 8, torch.float32), make_pool(1, 4, 1, 8, torch.float32, seed=1)
    before = dst[0][0].clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    pull_kv_rows(make_kv_row_table(*src, *dst), empty, empty)
    assert torch.equal(dst[0][0], before)


def test_pull_launchers_reject_bad_arguments() -> None:
    src, dst = make_pool(2, 10, 2, 8, torch.float32), make_pool(2, 10, 2, 8, torch.float32, seed=1)
    with pytest.raises(AssertionError, match="must share kv_heads and head_dim"):
        make_kv_row_table(*make_pool(2, 10, 1, 8, torch.float32), *dst)
    with pytest.raises(AssertionError, match="bit for bit"):
        make_kv_row_table(*make_pool(2, 10, 2, 8, torch.float16), *dst)
    with pytest.raises(AssertionError, match="as many K as V"):
        make_kv_row_table(src[0][:1], src[1], *dst)
    with pytest.raises(AssertionError, match="must be contiguous"):
        make_kv_row_table([b.transpose(1, 2).contiguous().transpose(1, 2) for b in src[0]], src[1], *dst)
    table = make_kv_row_table(*src, *dst)
    slots = torch.tensor([1, 2, 3], device=DEVICE)
    with pytest.raises(AssertionError, match="one per token"):
        pull_kv_rows(table, slots, slots[:2])
    with pytest.raises(AssertionError, match="expected int64"):
        pull_kv_rows(table, slots.int(), slots)
