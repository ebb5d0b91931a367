"""Tree attention (verifying EAGLE draft trees): the extend kernel's mask and the torch reference backend's, against
plain PyTorch (on CPU the kernel runs under the Triton interpreter, tiny shapes)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # must precede the first import of triton (radixmesh.kernels): @triton.jit reads it then
    os.environ["TRITON_INTERPRET"] = "1"

import random

import pytest

from radixmesh.engine.attention.base import AttentionLayerSpec, ForwardMode
from radixmesh.engine.attention.torch_native import TorchNativeBackend
from radixmesh.engine.attention.triton_backend import TritonBackend
from radixmesh.engine.memory import ReqToTokenPool, TokenToKVPool
from radixmesh.engine.speculative.tree import ancestor_mask, build_tree_mask
from radixmesh.kernels.extend_attention import extend_attention_fwd
from radixmesh.kernels.reference import attention_reference

from .test_triton_kernels import DEVICE, index_tensors, make_batch, make_problem, new_token_rows, new_token_slots


def random_tree(n: int, rng: random.Random) -> list[int]:
    """Row parents of an n-row tree, the root first and every parent before its children."""
    return [-1] + [rng.randrange(r) for r in range(1, n)]


def test_ancestor_mask_of_a_small_tree() -> None:
    #      0
    #    1   2
    #    3   4
    #        5
    mask = ancestor_mask([-1, 0, 0, 1, 2, 4])
    expected = [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                [1, 1, 0, 1, 0, 0], [1, 0, 1, 0, 1, 0], [1, 0, 1, 0, 1, 1]]
    assert mask.int().tolist() == expected


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 4, 16), (6, 2, 32)])
@pytest.mark.parametrize("own_rows", [False, True], ids=["slots", "own-rows"])
@pytest.mark.parametrize("blocks", [None, (32, 16, 4, 1)], ids=["default", "8x16"])
def test_extend_with_a_tree_mask_matches_reference(heads: int, kv_heads: int, head_dim: int, own_rows: bool,
                                                   blocks: tuple[int, int, int, int] | None) -> None:
    """Requests of 1 to 40 tree rows after prefixes of 0 to 70 tokens (several query blocks and key tiles per
    request), the new K/V gathered by slot or read from their own rows."""
    rng = random.Random(heads * head_dim + own_rows)
    new_lens, prefix_lens = [9, 1, 40, 5], [70, 3, 17, 0]
    trees = [random_tree(n, rng) for n in new_lens]
    p = make_problem(prefix_lens, new_lens, heads, kv_heads, head_dim, torch.float32, seed=len(trees))
    kv_indptr, kv_indices = index_tensors(p)
    masks = [ancestor_mask(t) for t in trees]
    expected = attention_reference(p.q, p.k_buf, p.v_buf, p.qo_indptr, kv_indptr.tolist(), kv_indices,
                                   head_dim**-0.5, tree_masks=masks)
    tree = build_tree_mask(trees, DEVICE)
    k_new = v_new = None
    if own_rows:
        k_new, v_new = new_token_rows(p, new_token_slots(p, kv_indptr, kv_indices))
    out = torch.full_like(p.q, float("nan"))
    extend_attention_fwd(p.q, p.k_buf, p.v_buf, out, torch.tensor(p.qo_indptr, device=DEVICE), kv_indptr, kv_indices,
                         max(new_lens), head_dim**-0.5, blocks=blocks, k_new=k_new, v_new=v_new,
                         custom_mask=tree.mask, mask_indptr=tree.indptr)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    causal = attention_reference(p.q, p.k_buf, p.v_buf, p.qo_indptr, kv_indptr.tolist(), kv_indices, head_dim**-0.5)
    assert not torch.allclose(causal, expected), "the trees changed nothing: the test would not see a lost mask"


def test_a_chain_mask_is_the_causal_kernel() -> None:
    new_lens = [6, 33]
    p = make_problem([12, 40], new_lens, 8, 2, 64, torch.float32, seed=9)
    kv_indptr, kv_indices = index_tensors(p)
    qo_indptr = torch.tensor(p.qo_indptr, device=DEVICE)
    tree = build_tree_mask([[r - 1 for r in range(n)] for n in new_lens], DEVICE)
    outs = []
    for mask in (None, tree):
        out = torch.full_like(p.q, float("nan"))
        extend_attention_fwd(p.q, p.k_buf, p.v_buf, out, qo_indptr, kv_indptr, kv_indices, max(new_lens), 0.125,
                             custom_mask=mask.mask if mask else None, mask_indptr=mask.indptr if mask else None)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)


def test_the_launcher_checks_the_mask() -> None:
    p = make_problem([4], [3], 4, 4, 16, torch.float32)
    kv_indptr, kv_indices = index_tensors(p)
    qo_indptr = torch.tensor(p.qo_indptr, device=DEVICE)
    out = torch.empty_like(p.q)
    tree = build_tree_mask([[-1, 0, 0]], DEVICE)
    with pytest.raises(AssertionError, match="come together"):
        extend_attention_fwd(p.q, p.k_buf, p.v_buf, out, qo_indptr, kv_indptr, kv_indices, 3, 1.0,
                             custom_mask=tree.mask)
    with pytest.raises(AssertionError, match="flat bool or uint8"):
        extend_attention_fwd(p.q, p.k_buf, p.v_buf, out, qo_indptr, kv_indptr, kv_indices, 3, 1.0,
                             custom_mask=tree.mask.float(), mask_indptr=tree.indptr)
    with pytest.raises(AssertionError, match="batch \\+ 1"):
        extend_attention_fwd(p.q, p.k_buf, p.v_buf, out, qo_indptr, kv_indptr, kv_indices, 3, 1.0,
                             custom_mask=tree.mask, mask_indptr=tree.indptr[:1])


@pytest.mark.parametrize("backend_cls", [TorchNativeBackend, TritonBackend], ids=["torch-native", "triton"])
def test_backends_take_the_tree_mask(backend_cls: type) -> None:
    """A verify-shaped pass (trees after cached prefixes) through each backend's forward, against the reference."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim = 4, 2, 16
    layer = AttentionLayerSpec(0, heads, kv_heads, head_dim, head_dim**-0.5)
    req_pool = ReqToTokenPool(3, 64, DEVICE)
    kv_pool = TokenToKVPool(100, 1, kv_heads, head_dim, torch.float32, DEVICE)
    rows, prefix_lens, new_lens = [1, 2], [20, 7], [8, 5]
    req_pool.req_to_token[1, :28] = torch.randperm(40, device=DEVICE)[:28] + 1
    req_pool.req_to_token[2, :12] = torch.randperm(40, device=DEVICE)[:12] + 50
    for row, n in zip(rows, prefix_lens):
        slots = req_pool.req_to_token[row, :n]
        kv_pool.set_kv(0, slots, torch.randn(n, kv_heads, head_dim, device=DEVICE),
                       torch.randn(n, kv_heads, head_dim, device=DEVICE))
    trees = [[-1, 0, 0, 1, 1, 2, 5, 3], [-1, 0, 1, 0, 3]]
    backend = backend_cls()
    fb = make_batch(ForwardMode.EXTEND, prefix_lens, new_lens, rows, req_pool, kv_pool, backend)
    fb.tree_mask = build_tree_mask(trees, DEVICE)
    n = sum(new_lens)
    q = torch.randn(n, heads, head_dim, device=DEVICE)
    k = torch.randn(n, kv_heads, head_dim, device=DEVICE)
    v = torch.randn(n, kv_heads, head_dim, device=DEVICE)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, layer, fb).view(n, heads, head_dim)
    seq_lens = [p + e for p, e in zip(prefix_lens, new_lens)]
    kv_indptr = [0, seq_lens[0], sum(seq_lens)]
    kv_indices = torch.cat([req_pool.req_to_token[r, :s] for r, s in zip(rows, seq_lens)])
    k_buf, v_buf = kv_pool.get_kv(0)
    expected = attention_reference(q, k_buf, v_buf, [0, new_lens[0], n], kv_indptr, kv_indices, layer.scaling,
                                   tree_masks=[ancestor_mask(t) for t in trees])
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
