"""Chained 64-bit keys of a prompt's full token blocks, shared by every service.

The prompt's token ids are cut into blocks of `block_size` tokens; only full blocks get a
key. Block i's key is the first 8 bytes (little-endian integer) of
blake2b(digest_size=8) over:

    parent key (block i-1's key; 0 for block 0) as 8 bytes little-endian
    len(extra_key) as 4 bytes little-endian
    extra_key (e.g. model id and cache salt; usually empty)
    the block's token ids, each as uint32 little-endian

Chaining makes a key stand for the whole prefix up to and including its block, so two
prompts share block i's key exactly when they share their first (i + 1) * block_size tokens.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DEFAULT_BLOCK_SIZE = 16
_MASK_32 = 0xFFFFFFFF


def block_hashes(token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE, extra_key: bytes = b"") -> list[int]:
    """Keys of the full blocks of `token_ids`, in order (len(token_ids) // block_size of them)."""
    assert block_size >= 1, f"block_size must be >= 1, got {block_size}"
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    salt = struct.pack("<I", len(extra_key)) + extra_key
    num_tokens = num_blocks * block_size
    full = token_ids[:num_tokens]
    try:  # every full block's ids at once: one pack, then a slice per block
        packed = struct.pack(f"<{num_tokens}I", *full)
    except struct.error as exc:
        bad = next((t for t in full if not 0 <= t <= _MASK_32), None)
        raise ValueError(f"token id {bad} does not fit in uint32") from exc
    block_bytes = 4 * block_size
    blake2b = hashlib.blake2b
    digests: list[bytes] = []
    parent = bytes(8)  # a key as 8 bytes little-endian is its digest itself: no int round trip per block
    for start in range(0, len(packed), block_bytes):
        parent = blake2b(parent + salt + packed[start:start + block_bytes], digest_size=8).digest()
        digests.append(parent)
    return [int.from_bytes(digest, "little") for digest in digests]


def num_full_blocks(num_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """How many full blocks `num_tokens` tokens make."""
    return num_tokens // block_size
