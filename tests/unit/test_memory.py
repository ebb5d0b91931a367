"""ReqToTokenPool, TokenToKVPool and KVSlotAllocator on CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.engine.memory import KVSlotAllocator, ReqToTokenPool, TokenToKVPool


def make_kv_pool(size: int = 8, dtype: torch.dtype = torch.float32) -> TokenToKVPool:
    return TokenToKVPool(size, num_layers=2, num_kv_heads=2, head_dim=4, dtype=dtype, device="cpu")


class TestReqToTokenPool:
    def test_table_shape_and_dtype(self) -> None:
        pool = ReqToTokenPool(4, 16, "cpu")
        assert pool.req_to_token.shape == (4, 16)
        assert pool.req_to_token.dtype == torch.int64

    def test_alloc_and_free(self) -> None:
        pool = ReqToTokenPool(4, 16, "cpu")
        rows = pool.alloc(3)
        assert rows is not None and len(set(rows)) == 3
        assert all(0 <= r < 4 for r in rows)
        assert pool.available_size() == 1
        assert pool.alloc(2) is None
        assert pool.available_size() == 1
        pool.free(rows[0])
        pool.free(rows[1:])
        assert pool.available_size() == 4

    def test_default_alloc_is_one_row(self) -> None:
        pool = ReqToTokenPool(2, 8, "cpu")
        rows = pool.alloc()
        assert rows is not None and len(rows) == 1

    def test_double_free_asserts(self) -> None:
        pool = ReqToTokenPool(2, 8, "cpu")
        rows = pool.alloc(1)
        assert rows is not None
        pool.free(rows)
        with pytest.raises(AssertionError, match="double free"):
            pool.free(rows[0])

    def test_free_of_never_allocated_row_asserts(self) -> None:
        pool = ReqToTokenPool(2, 8, "cpu")
        with pytest.raises(AssertionError, match="double free"):
            pool.free(1)

    def test_clear(self) -> None:
        pool = ReqToTokenPool(3, 8, "cpu")
        assert pool.alloc(3) is not None
        pool.clear()
        assert pool.available_size() == 3
        assert pool.alloc(3) is not None


class TestTokenToKVPool:
    def test_buffer_shapes(self) -> None:
        pool = make_kv_pool(size=8)
        assert pool.size == 8
        assert len(pool.k_buffers) == len(pool.v_buffers) == 2
        k, v = pool.get_kv(1)
        assert k.shape == v.shape == (9, 2, 4)
        assert k is pool.k_buffers[1] and v is pool.v_buffers[1]

    def test_set_kv_round_trip_and_cast(self) -> None:
        pool = make_kv_pool(size=8, dtype=torch.bfloat16)
        loc = torch.tensor([3, 1, 7])
        k = torch.randn(3, 2, 4)
        v = torch.randn(3, 2, 4)
        pool.set_kv(0, loc, k, v)
        k_buf, v_buf = pool.get_kv(0)
        assert k_buf.dtype == torch.bfloat16
        torch.testing.assert_close(k_buf[loc], k.to(torch.bfloat16))
        torch.testing.assert_close(v_buf[loc], v.to(torch.bfloat16))
        assert k_buf[0].abs().sum() == 0
        assert pool.get_kv(1)[0][0].abs().sum() == 0  # the dummy slot of an unwritten layer

    def test_set_kv_checks_shapes(self) -> None:
        pool = make_kv_pool()
        with pytest.raises(AssertionError, match="k shape"):
            pool.set_kv(0, torch.tensor([1, 2]), torch.zeros(3, 2, 4), torch.zeros(2, 2, 4))
        with pytest.raises(AssertionError, match="v shape"):
            pool.set_kv(0, torch.tensor([1, 2]), torch.zeros(2, 2, 4), torch.zeros(2, 2, 5))

    @pytest.mark.parametrize(
        ("dtype", "itemsize"), [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)]
    )
    def test_bytes_per_token(self, dtype: torch.dtype, itemsize: int) -> None:
        assert TokenToKVPool.bytes_per_token(28, 8, 128, dtype) == 2 * 28 * 8 * 128 * itemsize
        pool = make_kv_pool(size=5, dtype=dtype)
        per_layer = pool.k_buffers[0][1:].nbytes + pool.v_buffers[0][1:].nbytes
        assert per_layer * pool.num_layers == 5 * TokenToKVPool.bytes_per_token(2, 2, 4, dtype)


class TestKVSlotAllocator:
    def test_hands_out_slots_one_to_size(self) -> None:
        alloc = KVSlotAllocator(6, "cpu")
        slots = alloc.alloc(6)
        assert slots is not None
        assert slots.dtype == torch.int64
        assert sorted(slots.tolist()) == [1, 2, 3, 4, 5, 6]
        assert alloc.available_size() == 0
        assert alloc.alloc(1) is None

    def test_short_alloc_takes_nothing(self) -> None:
        alloc = KVSlotAllocator(4, "cpu")
        assert alloc.alloc(5) is None
        assert alloc.available_size() == 4

    def test_alloc_zero_and_free_empty(self) -> None:
        alloc = KVSlotAllocator(4, "cpu", check_double_free=True)
        empty = alloc.alloc(0)
        assert empty is not None and empty.numel() == 0
        alloc.free(torch.empty(0, dtype=torch.int64))
        assert alloc.available_size() == 4

    def test_free_returns_slots(self) -> None:
        alloc = KVSlotAllocator(4, "cpu")
        a = alloc.alloc(3)
        assert a is not None
        alloc.free(a[1:])
        assert alloc.available_size() == 3
        b = alloc.alloc(3)
        assert b is not None
        assert sorted(b.tolist() + a[:1].tolist()) == [1, 2, 3, 4]

    def test_free_accepts_other_int_dtype(self) -> None:
        alloc = KVSlotAllocator(4, "cpu")
        a = alloc.alloc(2)
        assert a is not None
        alloc.free(a.to(torch.int32))
        assert alloc._free_slots.dtype == torch.int64
        assert alloc.available_size() == 4

    def test_clear(self) -> None:
        alloc = KVSlotAllocator(4, "cpu", check_double_free=True)
        assert alloc.alloc(4) is not None
        alloc.clear()
        assert alloc.available_size() == 4
        assert alloc.alloc(4) is not None

    def test_debug_double_free_asserts(self) -> None:
        alloc = KVSlotAllocator(4, "cpu", check_double_free=True)
        a = alloc.alloc(2)
        assert a is not None
        alloc.free(a)
        with pytest.raises(AssertionError, match="double free"):
            alloc.free(a[:1])

    def test_debug_free_of_never_allocated_asserts(self) -> None:
        alloc = KVSlotAllocator(4, "cpu", check_double_free=True)
        with pytest.raises(AssertionError, match="double free"):
            alloc.free(torch.tensor([2]))

    def test_debug_duplicate_in_one_call_asserts(self) -> None:
        alloc = KVSlotAllocator(4, "cpu", check_double_free=True)
        assert alloc.alloc(4) is not None
        with pytest.raises(AssertionError, match="twice in one call"):
            alloc.free(torch.tensor([3, 3]))

    @pytest.mark.parametrize("slot", [0, 5])
    def test_debug_out_of_range_asserts(self, slot: int) -> None:
        alloc = KVSlotAllocator(4, "cpu", check_double_free=True)
        with pytest.raises(AssertionError, match="outside"):
            alloc.free(torch.tensor([slot]))

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=40))
    def test_random_alloc_free_conserves_slots(self, ops: list[tuple[bool, int]]) -> None:
        size = 16
        alloc = KVSlotAllocator(size, "cpu", check_double_free=True)
        held: list[int] = []
        for is_alloc, n in ops:
            if is_alloc:
                slots = alloc.alloc(n)
                if n > size - len(held):
                    assert slots is None
                else:
                    assert slots is not None and slots.numel() == n
                    held += slots.tolist()
            else:
                k = min(n, len(held))
                alloc.free(torch.tensor(held[:k], dtype=torch.int64))
                held = held[k:]
            assert alloc.available_size() == size - len(held)
            assert sorted(held + alloc._free_slots.tolist()) == list(range(1, size + 1))
