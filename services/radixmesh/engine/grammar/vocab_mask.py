"""Applying packed token masks to logits: the checked launcher and its plain-PyTorch reference.

A mask row packs 32 tokens per int32 word, token j in bit (j % 32) of word j // 32,
1 = allowed. The launcher checks shapes, dtypes and devices, then hands the work to
xgrammar's kernel (C++ on CPU, Triton on CUDA); only the rows of grammar requests are
touched, so the other requests in the batch pay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch


@dataclass
class VocabMask:
    """The masks of one sampling step: which rows of the logits they apply to."""

    mask: torch.Tensor
    """[batch, ceil(vocab / 32)] int32 on the logits' device; only `rows` are meaningful."""
    rows: list[int]
    """Rows of the batch that follow a grammar, ascending and unique."""
    rows_device: torch.Tensor | None = None
    """`rows` as int32 on the mask's device (GPU), so applying the mask copies nothing from the host."""


def num_mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_vocab_mask(logits: torch.Tensor, vocab_mask: VocabMask) -> None:
    """Set the logits of disallowed tokens to -inf in place, for `vocab_mask.rows` only."""
    mask, rows = vocab_mask.mask, vocab_mask.rows
    assert logits.dim() == 2, f"logits must be [batch, vocab], got shape {tuple(logits.shape)}"
    assert logits.dtype in (torch.float32, torch.float16, torch.bfloat16), f"logits dtype {logits.dtype}"
    assert logits.is_contiguous(), "logits must be contiguous"
    assert mask.dtype == torch.int32, f"mask must be int32, got {mask.dtype}"
    assert mask.dim() == 2 and mask.shape[1] == num_mask_words(logits.shape[1]), (
        f"mask {tuple(mask.shape)} does not pack logits {tuple(logits.shape)}")
    assert mask.shape[0] >= logits.shape[0], f"mask has {mask.shape[0]} rows for {logits.shape[0]} logits rows"
    assert mask.device == logits.device, f"mask on {mask.device}, logits on {logits.device}"
    assert rows and rows == sorted(set(rows)) and rows[0] >= 0 and rows[-1] < logits.shape[0], (
        f"rows must be unique, ascending and in [0, {logits.shape[0]}): {rows}")
    import xgrammar

    if vocab_mask.rows_device is not None:
        # xgrammar's CUDA (Triton) path takes the rows as a device tensor as they are; a list would
        # be copied from pageable memory, which waits for the forward pass queued before it
        xgrammar.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1], backend="triton",
                                             indices=cast("list[int]", vocab_mask.rows_device))
    else:
        xgrammar.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1], indices=rows)


def warm_up_vocab_mask(vocab_size: int, device: torch.device) -> bool:
    """Compile the CUDA mask kernel's variants before serving; False when xgrammar is not installed.

    Triton compiles a kernel once per kind of row count (one row, a multiple of 16, any other),
    which would otherwise cost the first grammar batches of each kind most of a second.
    """
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    words = num_mask_words(vocab_size)
    logits = torch.zeros(16, vocab_size, dtype=torch.float32, device=device)  # the sampler's logits dtype
    mask = torch.full((16, words), -1, dtype=torch.int32, device=device)
    for count in (1, 2, 16):
        rows = list(range(count))
        apply_vocab_mask(logits, VocabMask(mask, rows, torch.arange(count, dtype=torch.int32, device=device)))
    return True


def unpack_mask(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[batch, vocab] bool (True = allowed) from packed int32 words; the reference semantics."""
    bits = torch.arange(32, device=mask.device, dtype=torch.int32)
    unpacked = (mask.unsqueeze(-1) >> bits) & 1  # [batch, words, 32]
    return unpacked.reshape(mask.shape[0], -1)[:, :vocab_size].bool()


def apply_vocab_mask_reference(logits: torch.Tensor, vocab_mask: VocabMask) -> None:
    """Plain PyTorch version of `apply_vocab_mask`, for tests."""
    allowed = unpack_mask(vocab_mask.mask, logits.shape[1])
    for row in vocab_mask.rows:
        logits[row].masked_fill_(~allowed[row], float("-inf"))
