"""The block-hash convention every service shares (DESIGN.md section 5)."""

from __future__ import annotations

import hashlib

import pytest

from radixmesh.wire.block_hash import block_hashes


def _reference(token_ids: list[int], block_size: int, extra_key: bytes) -> list[int]:
    """The spec written out byte by byte, independent of the implementation's struct formats."""
    keys, parent = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        data = bytearray(parent.to_bytes(8, "little"))
        data += len(extra_key).to_bytes(4, "little") + extra_key
        for tok in token_ids[start:start + block_size]:
            data += tok.to_bytes(4, "little")
        parent = int.from_bytes(hashlib.blake2b(bytes(data), digest_size=8).digest(), "little")
        keys.append(parent)
    return keys


def test_fixed_vector() -> None:
    # Pinned values: any service in any language must reproduce these.
    assert block_hashes(list(range(32)), 16) == [14265003755956578523, 17067163845219201427]
    assert block_hashes(list(range(20)), 4, b"m") == [
        13325232498885766641, 10635635303401642546, 6536539257295123642, 11702685565783677080,
        5983006071334969749,
    ]


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("extra_key", [b"", b"model-a", b"\x00" * 9])
def test_matches_byte_layout(block_size: int, extra_key: bytes) -> None:
    ids = [7, 0, 49151, 2**32 - 1, 12, 99, 5, 5, 5, 1, 2, 3, 4, 8, 100000, 3, 17, 18, 19, 20, 21, 22, 23, 24, 9, 9]
    assert block_hashes(ids, block_size, extra_key) == _reference(ids, block_size, extra_key)


def test_only_full_blocks() -> None:
    assert block_hashes(list(range(15)), 16) == []
    assert block_hashes([], 16) == []
    assert len(block_hashes(list(range(47)), 16)) == 2
    assert block_hashes(list(range(47)), 16) == block_hashes(list(range(32)), 16)


def test_chained_prefix_property() -> None:
    a = list(range(64))
    b = [*range(32), 999, *range(33, 64)]
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2] and ha[3] != hb[3]  # the change in block 2 propagates down the chain
    same_block_elsewhere = block_hashes(list(range(16, 32)), 16)
    assert same_block_elsewhere[0] != ha[1]  # a block's key depends on its parent


def test_extra_key_separates_namespaces() -> None:
    ids = list(range(32))
    assert block_hashes(ids, 16, b"a") != block_hashes(ids, 16, b"b")
    assert block_hashes(ids, 16, b"") != block_hashes(ids, 16, b"a")
    assert all(0 <= k < 2**64 for k in block_hashes(ids, 16, b"a"))


def test_rejects_ids_outside_uint32() -> None:
    with pytest.raises(ValueError, match="uint32"):
        block_hashes([0] * 15 + [2**32], 16)
    with pytest.raises(ValueError, match="uint32"):
        block_hashes([-1] * 16, 16)
